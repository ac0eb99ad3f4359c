use loona_hpack::{Decoder, Encoder};

use super::*;
use crate::frames::{FrameHeader, HEADER_LEN, PREFACE};

const DATA: u8 = 0x0;
const SETTINGS: u8 = 0x4;

type Headers = Vec<(Vec<u8>, Vec<u8>)>;

fn h(pairs: &[(&str, &str)]) -> Headers {
    pairs
        .iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
}

fn request(authority: &str, path: &str) -> Headers {
    h(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-accept-encoding", "identity,deflate,gzip"),
    ])
}

fn encode(enc: &mut Encoder<'static>, headers: &Headers) -> Vec<u8> {
    enc.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())))
}

/// Frames of `bytes` (after the preface), as (header, payload).
fn frames(bytes: &[u8]) -> Vec<(FrameHeader, Vec<u8>)> {
    assert!(bytes.starts_with(PREFACE), "the preface passes first");
    let mut at = PREFACE.len();
    let mut out = Vec::new();
    while at < bytes.len() {
        let fh = FrameHeader::parse(&bytes[at..]).expect("a whole frame header");
        let end = at + HEADER_LEN + fh.len;
        out.push((fh, bytes[at + HEADER_LEN..end].to_vec()));
        at = end;
    }
    out
}

/// A header block being gathered as h2 reads it: stream, HEADERS flags, priority fields
/// and the fragment so far.
type Gathering = (u32, u8, Option<Vec<u8>>, Vec<u8>);

/// The header lists of `bytes`' header blocks, decoded as h2 would (one decoder for the
/// connection), with each block's HEADERS flags and priority fields.
fn blocks(bytes: &[u8]) -> Vec<(u32, u8, Option<Vec<u8>>, Headers)> {
    let mut dec = Decoder::new();
    let mut out = Vec::new();
    let mut cur: Option<Gathering> = None;
    for (fh, payload) in frames(bytes) {
        match fh.kind {
            HEADERS => {
                assert!(fh.len <= MAX_PAYLOAD);
                assert_eq!(fh.flags & PADDED, 0, "padding is not passed on");
                let (prio, frag) = if fh.flags & PRIORITY != 0 {
                    (Some(payload[..5].to_vec()), payload[5..].to_vec())
                } else {
                    (None, payload)
                };
                cur = Some((fh.stream, fh.flags, prio, frag));
            }
            CONTINUATION => {
                assert!(fh.len <= MAX_PAYLOAD);
                cur.as_mut().unwrap().3.extend_from_slice(&payload);
            }
            _ => continue,
        }
        if fh.flags & END_HEADERS != 0 {
            let (s, f, p, frag) = cur.take().unwrap();
            out.push((
                s,
                f,
                p,
                dec.decode(&frag).expect("decodes as h2 decodes it"),
            ));
        }
    }
    out
}

fn client_connection() -> (Vec<u8>, Vec<Headers>) {
    let mut enc = Encoder::new();
    let mut c = PREFACE.to_vec();
    FrameHeader::write(SETTINGS, 0, 0, &[0, 4, 0, 0, 0xff, 0xff], &mut c);
    let sent = vec![
        request(
            "/var/lib/kubelet/plugins_registry/x-reg.sock",
            "/pluginregistration.Registration/GetInfo",
        ),
        // Indexed from the first block's dynamic table by the client's encoder.
        request(
            "/var/lib/kubelet/plugins_registry/x-reg.sock",
            "/pluginregistration.Registration/NotifyRegistrationStatus",
        ),
        request("localhost", "/shareguard.v1.NodeAgent/ListDevices"),
    ];
    for (i, r) in sent.iter().enumerate() {
        let stream = 1 + 2 * i as u32;
        FrameHeader::write(HEADERS, END_HEADERS, stream, &encode(&mut enc, r), &mut c);
        FrameHeader::write(DATA, END_STREAM, stream, &[0, 0, 0, 0, 0], &mut c);
    }
    (c, sent)
}

fn with_localhost(mut hs: Headers) -> Headers {
    for (n, v) in &mut hs {
        if n == b":authority" {
            *v = b"localhost".to_vec();
        }
    }
    hs
}

#[test]
fn socket_paths_become_localhost_and_everything_else_is_as_sent() {
    let (input, sent) = client_connection();
    let mut n = Normalizer::new();
    let mut out = Vec::new();
    n.feed(&input, &mut out);
    assert!(!n.gave_up());
    assert_eq!(n.rewritten(), 2);
    let got = blocks(&out);
    assert_eq!(got.len(), 3);
    for ((stream, flags, prio, headers), want) in got.into_iter().zip(sent) {
        assert_eq!(headers, with_localhost(want), "stream {stream}");
        assert_eq!(flags & END_HEADERS, END_HEADERS);
        assert_eq!(prio, None);
    }
    // The other frames, byte for byte.
    let others = |b: &[u8]| -> Vec<(FrameHeader, Vec<u8>)> {
        frames(b)
            .into_iter()
            .filter(|(f, _)| f.kind != HEADERS)
            .collect()
    };
    assert_eq!(others(&out), others(&input));
}

#[test]
fn any_split_of_the_input_gives_the_same_output() {
    let (input, _) = client_connection();
    let mut whole = Vec::new();
    Normalizer::new().feed(&input, &mut whole);
    for step in [1, 2, 3, 7, 9, 10, 64] {
        let mut n = Normalizer::new();
        let mut out = Vec::new();
        for chunk in input.chunks(step) {
            n.feed(chunk, &mut out);
        }
        n.finish(&mut out);
        assert_eq!(out, whole, "fed {step} bytes at a time");
    }
}

#[test]
fn padding_priority_and_continuations_are_followed() {
    let mut enc = Encoder::new();
    let block = encode(
        &mut enc,
        &request(
            "%2Frun%2Fshareguard%2Fagent.sock",
            "/shareguard.v1.NodeAgent/Prepare",
        ),
    );
    let (a, b) = block.split_at(block.len() / 2);
    let mut input = PREFACE.to_vec();
    // PADDED | PRIORITY | END_STREAM, no END_HEADERS: a CONTINUATION ends the block.
    let mut payload = vec![3]; // pad length
    payload.extend_from_slice(&[0x80, 0, 0, 0, 0x10]); // exclusive, depends on 0, weight 16
    payload.extend_from_slice(a);
    payload.extend_from_slice(&[0, 0, 0]);
    FrameHeader::write(
        HEADERS,
        PADDED | PRIORITY | END_STREAM,
        5,
        &payload,
        &mut input,
    );
    FrameHeader::write(CONTINUATION, END_HEADERS, 5, b, &mut input);
    let mut n = Normalizer::new();
    let mut out = Vec::new();
    n.feed(&input, &mut out);
    let got = blocks(&out);
    assert_eq!(got.len(), 1);
    let (stream, flags, prio, headers) = &got[0];
    assert_eq!(*stream, 5);
    assert_eq!(flags & (END_STREAM | PRIORITY), END_STREAM | PRIORITY);
    assert_eq!(prio.as_deref(), Some(&[0x80, 0, 0, 0, 0x10][..]));
    assert_eq!(
        headers,
        &with_localhost(request("x", "/shareguard.v1.NodeAgent/Prepare"))
    );
}

#[test]
fn a_block_larger_than_a_frame_is_split_into_continuations() {
    let mut enc = Encoder::new();
    let mut big = request("/a.sock", "/svc/M");
    big.push((b"x-big".to_vec(), vec![b'v'; 40_000]));
    let mut input = PREFACE.to_vec();
    let block = encode(&mut enc, &big);
    for (i, chunk) in block.chunks(16_000).enumerate() {
        let kind = if i == 0 { HEADERS } else { CONTINUATION };
        let last = (i + 1) * 16_000 >= block.len();
        FrameHeader::write(
            kind,
            if last { END_HEADERS } else { 0 },
            1,
            chunk,
            &mut input,
        );
    }
    let mut out = Vec::new();
    Normalizer::new().feed(&input, &mut out);
    let kinds: Vec<u8> = frames(&out).iter().map(|(f, _)| f.kind).collect();
    assert!(kinds.len() >= 3, "{kinds:?}");
    assert_eq!(blocks(&out)[0].3, with_localhost(big));
}

#[test]
fn what_does_not_decode_passes_on_as_sent_and_the_rest_with_it() {
    let mut input = PREFACE.to_vec();
    // An indexed field with index 0: not valid HPACK.
    FrameHeader::write(HEADERS, END_HEADERS, 1, &[0x80], &mut input);
    FrameHeader::write(DATA, END_STREAM, 1, &[1, 2, 3], &mut input);
    let mut n = Normalizer::new();
    let mut out = Vec::new();
    n.feed(&input[..input.len() - 4], &mut out);
    n.feed(&input[input.len() - 4..], &mut out);
    assert!(n.gave_up());
    assert_eq!(out, input, "h2 reads what the client sent and answers it");
}

#[test]
fn a_frame_in_the_middle_of_a_block_gives_up_without_losing_bytes() {
    let mut enc = Encoder::new();
    let block = encode(&mut enc, &request("/a.sock", "/svc/M"));
    let mut input = PREFACE.to_vec();
    FrameHeader::write(HEADERS, 0, 1, &block, &mut input);
    FrameHeader::write(DATA, 0, 1, &[9], &mut input);
    let mut n = Normalizer::new();
    let mut out = Vec::new();
    n.feed(&input, &mut out);
    assert!(n.gave_up());
    assert_eq!(out, input);
}

/// An HPACK bomb: one 4 KiB header added to the dynamic table, then a 1 MiB block of
/// one-byte references to it, which would decode to 4 GiB. The normaliser stops counting
/// at its bound, copies nothing past it, and passes the bytes on for h2 to refuse.
#[test]
fn a_header_block_that_expands_past_the_bound_is_passed_on_undecoded() {
    let mut block = Vec::new();
    // Literal with incremental indexing, new name: 0x40, name length, name, value
    // length (as a 7-bit prefix integer), value.
    block.extend_from_slice(&[0x40, 1, b'x']);
    let value = vec![b'v'; 4000];
    // 4000 = 127 + 3873: the prefix saturates, then 3873 in 7-bit groups.
    block.extend_from_slice(&[0x7f, (3873 % 128) as u8 | 0x80, (3873 / 128) as u8]);
    block.extend_from_slice(&value);
    // Index 62: the newest dynamic entry.
    block.resize(block.len() + (1 << 20) - 8192, 0x80 | 62);
    let mut input = PREFACE.to_vec();
    let mut chunks = block.chunks(MAX_PAYLOAD).peekable();
    let first = chunks.next().unwrap();
    let last_flag = |more: bool| if more { 0 } else { END_HEADERS };
    FrameHeader::write(
        HEADERS,
        last_flag(chunks.peek().is_some()),
        1,
        first,
        &mut input,
    );
    while let Some(c) = chunks.next() {
        FrameHeader::write(
            CONTINUATION,
            last_flag(chunks.peek().is_some()),
            1,
            c,
            &mut input,
        );
    }
    let mut n = Normalizer::new();
    let mut out = Vec::new();
    n.feed(&input, &mut out);
    assert!(
        n.gave_up(),
        "a 1 GiB header list was decoded and encoded again"
    );
    assert_eq!(out, input, "passed on as sent");
}
