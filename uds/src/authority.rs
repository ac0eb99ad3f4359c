//! Which `:authority` values a unix-socket client sends that h2 refuses, and what they
//! become.

/// What every normalised authority becomes: the name grpc-go and tonic's own client
/// send on a unix socket.
pub const LOCALHOST: &[u8] = b"localhost";

/// The authority h2 should see instead of `authority`, or None to leave it as it is.
/// Rewritten: empty, or a path, raw (`/var/lib/kubelet/plugins_registry/x-reg.sock`, as
/// grpc-go and kubelet send it) or percent-encoded (grpc C-core sends
/// `var%2Flib%2Fkubelet%2F...`, the path without its first slash): a client naming the
/// socket it dialled, by whatever path it sees it at. A `/` is never valid in an
/// authority, so this only turns requests h2 would refuse into ones it takes; anything
/// else stays as sent, and a malformed authority of another kind is still refused.
pub fn normalized(authority: &[u8]) -> Option<&'static [u8]> {
    if authority.is_empty() || authority.contains(&b'/') {
        return Some(LOCALHOST);
    }
    percent_decoded(authority)
        .filter(|d| d.contains(&b'/'))
        .map(|_| LOCALHOST)
}

/// `s` with `%XX` escapes decoded; None when an escape is malformed.
fn percent_decoded(s: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            let v = std::str::from_utf8(hex)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())?;
            out.push(v);
            i += 3;
        } else {
            out.push(s[i]);
            i += 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_paths_and_empty_become_localhost_and_nothing_else_changes() {
        for given in [
            &b"/var/lib/kubelet/plugins_registry/x-reg.sock"[..],
            b"%2Fvar%2Flib%2Fkubelet%2Fplugins%2Fx%2Fdra.sock",
            b"%2fvar%2frun%2fshareguard%2fagent.sock",
            b"tmp%2Fsg-it-x%2Fagent.sock",
            b"run/shareguard/agent.sock",
            b"unix:/var/run/x.sock",
            b"",
        ] {
            assert_eq!(normalized(given), Some(LOCALHOST), "{given:?}");
        }
        for kept in [
            &b"localhost"[..],
            b"localhost:50051",
            b"127.0.0.1:8080",
            b"example.com",
            b"bad authority with spaces",
            b"%zz",
        ] {
            assert_eq!(normalized(kept), None, "{kept:?}");
        }
    }
}
