//! `Config::parse` on arbitrary text: a bad configuration is an error naming a line of
//! the file, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shareguard::config::Config;

fuzz_target!(|data: &[u8]| {
    // The agent reads its config with read_to_string, which refuses anything not UTF-8.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = Config::parse(text, "fuzz") {
        // 0 when the error has no position; else a line of the text (or the one after
        // it, for an error at the very end).
        assert!(
            e.line <= text.lines().count() + 1,
            "line {} of {text:?}: {e}",
            e.line
        );
        let _ = e.to_string();
    }
});
