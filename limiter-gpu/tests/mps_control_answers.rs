//! Every answer of NVIDIA's MPS control program that shareguard reads
//! (`tests/fixtures/mps-control-answers.txt`, with its sources named there), through the
//! parsers the MPS manager uses: what a limit, a PID list or a set command's answer must
//! be taken as, and which answers must be refused rather than guessed at.

use shareguard_limiter_gpu::mps::{parse_pids, parse_shown, set_answer};

const FIXTURE: &str = include_str!("fixtures/mps-control-answers.txt");

struct Case<'a> {
    command: &'a str,
    answer: String,
    expected: &'a str,
}

fn cases() -> Vec<Case<'static>> {
    FIXTURE
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let parts: Vec<&str> = l.split(" | ").collect();
            let [command, answer, expected] = parts[..] else {
                panic!("fixture line {l:?} is not <command> | <answer> | <expected>");
            };
            let answer = if answer == "\"\"" {
                String::new()
            } else {
                answer.replace("\\n", "\n")
            };
            Case {
                command,
                answer,
                expected,
            }
        })
        .collect()
}

#[test]
fn every_recorded_answer_is_read_as_the_fixture_says() {
    let cases = cases();
    assert!(
        cases.len() >= 15,
        "the fixture lost its cases: {}",
        cases.len()
    );
    for c in &cases {
        let what = format!("{} answering {:?}", c.command, c.answer);
        let verb = c.command.split_whitespace().next().unwrap_or_default();
        let mut expected = c.expected.split_whitespace();
        match expected.next() {
            Some("limit") => {
                let want: Vec<u64> = expected.map(|n| n.parse().unwrap()).collect();
                let got = parse_shown(&c.answer).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(vec![got.bytes, got.granularity], want, "{what}");
            }
            Some("pids") => {
                let want: Vec<u32> = expected.map(|n| n.parse().unwrap()).collect();
                let got = parse_pids(&c.answer, verb).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(got, want, "{what}");
            }
            Some("accepted") => {
                set_answer(c.answer.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
            }
            Some("refused") => {
                let e = set_answer(c.answer.clone()).expect_err(&what);
                assert!(e.to_string().contains(c.answer.trim()), "{what}: {e}");
            }
            Some("error") => {
                let refused = if verb.starts_with("get_") && verb.ends_with("_limit") {
                    parse_shown(&c.answer).is_err()
                } else {
                    parse_pids(&c.answer, verb).is_err()
                };
                assert!(refused, "{what} must be refused, not guessed at");
            }
            other => panic!("{what}: unknown expectation {other:?}"),
        }
    }
}
