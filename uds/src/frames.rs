//! The few pieces of HTTP/2 framing (RFC 9113 section 4) the normaliser needs.

/// The client connection preface, which precedes the first frame.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub const HEADER_LEN: usize = 9;

pub const HEADERS: u8 = 0x1;
pub const CONTINUATION: u8 = 0x9;

pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const PADDED: u8 = 0x8;
pub const PRIORITY: u8 = 0x20;

/// The largest payload every peer accepts (SETTINGS_MAX_FRAME_SIZE's initial value);
/// what the normaliser writes stays within it.
pub const MAX_PAYLOAD: usize = 16_384;

/// A frame's 9-byte header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub len: usize,
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
}

impl FrameHeader {
    pub fn parse(b: &[u8]) -> Option<FrameHeader> {
        let h: &[u8; HEADER_LEN] = b.get(..HEADER_LEN)?.try_into().ok()?;
        Some(FrameHeader {
            len: usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]),
            kind: h[3],
            flags: h[4],
            stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff,
        })
    }

    /// Appends the header and `payload` (which must fit 24 bits) to `out`.
    pub fn write(kind: u8, flags: u8, stream: u32, payload: &[u8], out: &mut Vec<u8>) {
        let len = payload.len();
        out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
        out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
        out.extend_from_slice(payload);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let mut out = Vec::new();
        FrameHeader::write(
            HEADERS,
            END_HEADERS | END_STREAM,
            0x7fff_fffd,
            &[1, 2, 3],
            &mut out,
        );
        assert_eq!(
            FrameHeader::parse(&out),
            Some(FrameHeader {
                len: 3,
                kind: HEADERS,
                flags: END_HEADERS | END_STREAM,
                stream: 0x7fff_fffd
            })
        );
        assert_eq!(&out[HEADER_LEN..], &[1, 2, 3]);
        assert_eq!(FrameHeader::parse(&out[..8]), None);
    }
}
