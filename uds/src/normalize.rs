//! The normaliser: the bytes a client sends in, the same connection for h2 out, every
//! header block decoded, its `:authority` normalised ([`crate::authority`]) and encoded
//! again. No I/O here: [`Normalizer::feed`] takes what was read and appends what h2
//! should read.
//!
//! Every header block is re-encoded, not only those with something to change: h2's
//! decoder follows the dynamic table of the encoder here, which a block passed on as the
//! client encoded it (against the client's table) would break. Headers are encoded with
//! the same encoder for the whole connection, in the order h2 reads them. The client's
//! other frames (SETTINGS, DATA, WINDOW_UPDATE, PING, RST_STREAM, GOAWAY...) pass
//! through unchanged. What the normaliser cannot follow (a header block that does not
//! decode, frames out of order, a frame larger than anything h2 accepts) it stops
//! touching: from there on h2 reads exactly what the client sent and answers it as it
//! would without the normaliser.

use loona_hpack::{Decoder, Encoder};

use crate::{
    authority::normalized,
    frames::{
        CONTINUATION, END_HEADERS, END_STREAM, FrameHeader, HEADER_LEN, HEADERS, MAX_PAYLOAD,
        PADDED, PREFACE, PRIORITY,
    },
};

/// A frame larger than this is passed on untouched (h2's own limit is far lower).
const MAX_FRAME: usize = 1 << 20;
/// A header block larger than this likewise (h2 refuses header lists long before).
const MAX_BLOCK: usize = 1 << 20;
/// The largest header list this decodes, counted as HPACK counts a table entry (name,
/// value and 32 bytes each). HPACK lets a few bytes name a large table entry again and
/// again: a 1 MiB block of one-byte references to a 4 KiB entry decodes to 4 GiB. A
/// gRPC request's headers take a few hundred bytes; h2 refuses lists above its own
/// limit (16 KiB in hyper's server), so nothing legitimate is near this.
const MAX_HEADER_LIST: usize = 64 << 10;
/// The dynamic table size h2 lets a client's encoder use (its SETTINGS_HEADER_TABLE_SIZE,
/// which tonic leaves at the default): a larger size update is the client's error.
const TABLE_SIZE: usize = 4096;

/// One header block being gathered: a HEADERS frame and its CONTINUATIONs.
struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
    /// The frames as the client sent them, for when the normaliser gives up.
    raw: Vec<u8>,
}

pub struct Normalizer {
    /// Bytes of the client preface still to pass before frames begin.
    preface_left: usize,
    /// What was read and is not a whole frame yet.
    pending: Vec<u8>,
    block: Option<Block>,
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    /// Set once the normaliser gave up on the connection (see the module comment).
    passthrough: bool,
    rewritten: u64,
}

impl Default for Normalizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Normalizer {
    pub fn new() -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        Normalizer {
            preface_left: PREFACE.len(),
            pending: Vec::new(),
            block: None,
            decoder,
            encoder: Encoder::new(),
            passthrough: false,
            rewritten: 0,
        }
    }

    /// Header blocks whose authority was replaced so far.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Whether the normaliser stopped touching the connection.
    pub fn gave_up(&self) -> bool {
        self.passthrough
    }

    /// Takes the next bytes the client sent; appends what h2 should read to `out`.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) {
        if self.preface_left > 0 {
            let n = self.preface_left.min(input.len());
            out.extend_from_slice(&input[..n]);
            self.preface_left -= n;
            input = &input[n..];
        }
        if self.passthrough {
            out.extend_from_slice(input);
            return;
        }
        self.pending.extend_from_slice(input);
        let buf = std::mem::take(&mut self.pending);
        let mut at = 0;
        while let Some(h) = FrameHeader::parse(&buf[at..]) {
            if h.len > MAX_FRAME {
                self.give_up(&buf[at..], out);
                return;
            }
            let end = at + HEADER_LEN + h.len;
            if buf.len() < end {
                break;
            }
            if !self.frame(h, &buf[at..end], out) {
                self.give_up(&buf[end..], out);
                return;
            }
            at = end;
        }
        self.pending = buf[at..].to_vec();
    }

    /// What is left at the end of the input: a partial frame goes to h2 as it is, which
    /// then sees the connection end in the middle of it, as it would have.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        if let Some(b) = self.block.take() {
            out.extend_from_slice(&b.raw);
        }
        out.append(&mut self.pending);
    }

    /// Stops normalising: what is held back and `rest` go out as the client sent them.
    fn give_up(&mut self, rest: &[u8], out: &mut Vec<u8>) {
        tracing::debug!(
            "unix socket client's header blocks cannot be followed; passing its bytes on unchanged"
        );
        self.passthrough = true;
        if let Some(b) = self.block.take() {
            out.extend_from_slice(&b.raw);
        }
        out.extend_from_slice(rest);
    }

    /// Handles one whole frame; false when the normaliser must give up (the frame itself
    /// already went out as it came).
    fn frame(&mut self, h: FrameHeader, raw: &[u8], out: &mut Vec<u8>) -> bool {
        let payload = &raw[HEADER_LEN..];
        match (h.kind, self.block.take()) {
            (HEADERS, None) => {
                let Some((priority, fragment)) = split_headers(h.flags, payload) else {
                    out.extend_from_slice(raw);
                    return false;
                };
                let b = Block {
                    stream: h.stream,
                    end_stream: h.flags & END_STREAM != 0,
                    priority,
                    fragment: fragment.to_vec(),
                    raw: raw.to_vec(),
                };
                self.gathered(b, h.flags, out)
            }
            (CONTINUATION, Some(mut b)) if h.stream == b.stream => {
                b.fragment.extend_from_slice(payload);
                b.raw.extend_from_slice(raw);
                if b.fragment.len() > MAX_BLOCK {
                    out.extend_from_slice(&b.raw);
                    return false;
                }
                self.gathered(b, h.flags, out)
            }
            (_, Some(b)) => {
                // Anything but the block's CONTINUATION in the middle of it: a connection
                // error, h2's to report.
                out.extend_from_slice(&b.raw);
                out.extend_from_slice(raw);
                false
            }
            (_, None) => {
                out.extend_from_slice(raw);
                true
            }
        }
    }

    /// A block with one more frame: written out once its END_HEADERS came.
    fn gathered(&mut self, b: Block, flags: u8, out: &mut Vec<u8>) -> bool {
        if flags & END_HEADERS == 0 {
            self.block = Some(b);
            return true;
        }
        // The decoder hands each field over borrowed; only fields within the bound are
        // copied, so what the block expands to never has to fit in memory.
        let mut headers = Vec::new();
        let mut size = 0usize;
        let decoded = self.decoder.decode_with_cb(&b.fragment, |name, value| {
            size = size.saturating_add(name.len() + value.len() + 32);
            if size <= MAX_HEADER_LIST {
                headers.push((name.into_owned(), value.into_owned()));
            }
        });
        match decoded {
            Ok(()) if size <= MAX_HEADER_LIST => {
                self.write_block(&b, headers, out);
                true
            }
            Ok(()) => {
                tracing::debug!(
                    size,
                    max = MAX_HEADER_LIST,
                    "a unix socket client's header list is too large to normalise"
                );
                out.extend_from_slice(&b.raw);
                false
            }
            Err(e) => {
                tracing::debug!(error = ?e, "a unix socket client's header block does not decode");
                out.extend_from_slice(&b.raw);
                false
            }
        }
    }

    /// Encodes `headers` (the authority normalised) as the block of stream `b.stream`:
    /// a HEADERS frame and, when it does not fit one, CONTINUATIONs.
    fn write_block(&mut self, b: &Block, headers: Vec<(Vec<u8>, Vec<u8>)>, out: &mut Vec<u8>) {
        let mut changed = false;
        let headers: Vec<(Vec<u8>, Vec<u8>)> = headers
            .into_iter()
            .map(|(name, value)| {
                match (name.as_slice() == b":authority")
                    .then(|| normalized(&value))
                    .flatten()
                {
                    Some(new) => {
                        changed = true;
                        (name, new.to_vec())
                    }
                    None => (name, value),
                }
            })
            .collect();
        if changed {
            self.rewritten += 1;
        }
        let block = self
            .encoder
            .encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut first = Vec::with_capacity(MAX_PAYLOAD.min(block.len() + 5));
        if let Some(p) = b.priority {
            first.extend_from_slice(&p);
        }
        let room = MAX_PAYLOAD - first.len();
        let (head, rest) = block.split_at(room.min(block.len()));
        first.extend_from_slice(head);
        let mut flags = 0;
        if b.end_stream {
            flags |= END_STREAM;
        }
        if b.priority.is_some() {
            flags |= PRIORITY;
        }
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        FrameHeader::write(HEADERS, flags, b.stream, &first, out);
        let chunks: Vec<&[u8]> = rest.chunks(MAX_PAYLOAD).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let flags = if last { END_HEADERS } else { 0 };
            FrameHeader::write(CONTINUATION, flags, b.stream, chunk, out);
        }
    }
}

/// A HEADERS payload's priority fields and header block fragment, padding removed;
/// None when the payload is shorter than its flags say.
fn split_headers(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut p = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        let (&n, rest) = p.split_first()?;
        pad = usize::from(n);
        p = rest;
    }
    let priority = if flags & PRIORITY != 0 {
        let pr: [u8; 5] = p.get(..5)?.try_into().ok()?;
        p = &p[5..];
        Some(pr)
    } else {
        None
    };
    let end = p.len().checked_sub(pad)?;
    Some((priority, &p[..end]))
}

#[cfg(test)]
#[path = "normalize_tests.rs"]
mod tests;
