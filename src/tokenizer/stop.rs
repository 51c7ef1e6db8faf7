//! Stop strings that may span token boundaries (vLLM semantics).
//!
//! After each detokenized delta the caller appends it to the output text and calls
//! [`StopChecker::check`] with the delta's length. Only the region that can contain a *new*
//! match is searched: the delta plus `len(stop) - 1` bytes before it. On a match the output is
//! truncated at [`StopMatch::truncate_at`] (before the stop string, or after it when the stop
//! string is to be included in the output) and generation ends.
//!
//! Lengths and offsets are in bytes of the UTF-8 text.

/// A stop string found in the output text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopMatch {
    /// The stop string that matched.
    pub stop: String,
    /// Byte offset at which the output text must be truncated (a char boundary).
    pub truncate_at: usize,
}

/// Detects stop strings in a growing output text.
#[derive(Debug, Clone, Default)]
pub struct StopChecker {
    stops: Vec<String>,
    max_len: usize,
    include_in_output: bool,
}

impl StopChecker {
    /// A checker for `stops`; empty strings are ignored, duplicates removed.
    pub fn new<I, S>(stops: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut list: Vec<String> = Vec::new();
        for s in stops {
            let s = s.into();
            if !s.is_empty() && !list.contains(&s) {
                list.push(s);
            }
        }
        let max_len = list.iter().map(String::len).max().unwrap_or(0);
        StopChecker {
            stops: list,
            max_len,
            include_in_output: false,
        }
    }

    /// Keep the stop string in the output (vLLM's `include_stop_str_in_output`): the text is
    /// truncated after the stop string instead of before it, and nothing needs to be held back.
    pub fn include_in_output(mut self, yes: bool) -> Self {
        self.include_in_output = yes;
        self
    }

    /// The stop strings.
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// Whether there are no stop strings.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Finds a stop string in `text` whose match overlaps the last `new_delta_len` bytes (the
    /// delta just appended). Earlier text is assumed to have been checked already. When several
    /// stop strings match, the one starting earliest wins (ties: the one listed first).
    pub fn check(&self, text: &str, new_delta_len: usize) -> Option<StopMatch> {
        if new_delta_len == 0 || self.stops.is_empty() {
            return None;
        }
        let delta_start = floor_char_boundary(text, text.len().saturating_sub(new_delta_len));
        let mut best: Option<(usize, &String)> = None;
        for stop in &self.stops {
            let from = floor_char_boundary(text, delta_start.saturating_sub(stop.len() - 1));
            let Some(pos) = text[from..].find(stop.as_str()).map(|p| p + from) else {
                continue;
            };
            if best.is_none_or(|(b, _)| pos < b) {
                best = Some((pos, stop));
            }
        }
        best.map(|(pos, stop)| StopMatch {
            stop: stop.clone(),
            truncate_at: if self.include_in_output {
                pos + stop.len()
            } else {
                pos
            },
        })
    }

    /// How many trailing bytes of the output a streaming caller must hold back because they
    /// might become the start of a stop string: longest stop string length − 1 (0 without stop
    /// strings, or when stop strings are included in the output).
    pub fn holdback(&self) -> usize {
        if self.include_in_output {
            0
        } else {
            self.max_len.saturating_sub(1)
        }
    }

    /// How many leading bytes of `text` (output with no complete stop string in it, i.e. after
    /// [`check`](Self::check)) can be streamed now. Tighter than `text.len() - holdback()`: only
    /// a tail that actually is a proper prefix of some stop string is held back. Always a char
    /// boundary.
    pub fn emittable_len(&self, text: &str) -> usize {
        let hold = self.holdback();
        if hold == 0 {
            return text.len();
        }
        let bytes = text.as_bytes();
        let first = text.len().saturating_sub(hold);
        for start in first..text.len() {
            if !text.is_char_boundary(start) {
                continue;
            }
            let tail = &bytes[start..];
            if self
                .stops
                .iter()
                .any(|s| s.len() > tail.len() && s.as_bytes().starts_with(tail))
            {
                return start;
            }
        }
        text.len()
    }
}

/// The largest char boundary of `s` that is `<= i`.
fn floor_char_boundary(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_util::tokenizer;
    use crate::tokenizer::IncrementalDetokenizer;

    /// Feeds `deltas` one by one; returns the final (possibly truncated) text, the match and
    /// what a streaming client would have received.
    fn run(checker: &StopChecker, deltas: &[&str]) -> (String, Option<StopMatch>, String) {
        let mut text = String::new();
        let mut sent = 0;
        for d in deltas {
            text.push_str(d);
            if let Some(m) = checker.check(&text, d.len()) {
                text.truncate(m.truncate_at);
                return (text.clone(), Some(m), text);
            }
            let n = checker.emittable_len(&text);
            assert!(n >= sent, "emitted text must never be retracted");
            assert!(text.len() - n <= checker.holdback());
            sent = n;
        }
        let streamed = text[..sent].to_string();
        (text, None, streamed)
    }

    #[test]
    fn stop_within_one_delta() {
        let c = StopChecker::new(["STOP"]);
        let (text, m, _) = run(&c, &["hello STOP world"]);
        assert_eq!(text, "hello ");
        assert_eq!(
            m,
            Some(StopMatch {
                stop: "STOP".into(),
                truncate_at: 6
            })
        );
    }

    #[test]
    fn stop_across_deltas() {
        let c = StopChecker::new(["</end>", "\n\n"]);
        let (text, m, streamed) = run(&c, &["abc </", "e", "nd> more"]);
        assert_eq!(text, "abc ");
        assert_eq!(m.unwrap().stop, "</end>");
        assert_eq!(streamed, "abc ");

        let (text, m, _) = run(&c, &["line\n", "\nnext"]);
        assert_eq!(text, "line");
        assert_eq!(m.unwrap().stop, "\n\n");
    }

    #[test]
    fn earliest_match_wins() {
        let c = StopChecker::new(["world", "o w"]);
        let (text, m, _) = run(&c, &["hello", " world"]);
        assert_eq!(text, "hell");
        assert_eq!(m.unwrap().stop, "o w");
    }

    #[test]
    fn only_new_region_is_searched() {
        let c = StopChecker::new(["ab"]);
        // "ab" lies entirely before the region of the last 1-byte delta.
        assert_eq!(c.check("xxabxxy", 1), None);
        assert_eq!(c.check("xxabxxy", 0), None);
        assert_eq!(c.check("xxa", 1), None);
        assert_eq!(c.check("xxab", 1).map(|m| m.truncate_at), Some(2));
        // A delta length larger than the text is clamped.
        assert_eq!(c.check("ab", 10).map(|m| m.truncate_at), Some(0));
    }

    #[test]
    fn include_in_output() {
        let c = StopChecker::new(["STOP"]).include_in_output(true);
        assert_eq!(c.holdback(), 0);
        let (text, m, _) = run(&c, &["a ST", "OP b"]);
        assert_eq!(text, "a STOP");
        assert_eq!(m.unwrap().truncate_at, 6);
    }

    #[test]
    fn holdback_and_emittable() {
        let c = StopChecker::new(["", "STOP", "é!", "STOP"]);
        assert_eq!(c.stops(), &["STOP".to_string(), "é!".to_string()]);
        assert_eq!(c.holdback(), 3);
        assert_eq!(StopChecker::new(Vec::<String>::new()).holdback(), 0);
        assert!(StopChecker::default().is_empty());
        assert_eq!(c.emittable_len("hello"), 5);
        assert_eq!(c.emittable_len("hello S"), 6);
        assert_eq!(c.emittable_len("hello ST"), 6);
        assert_eq!(c.emittable_len("hello STO"), 6);
        assert_eq!(c.emittable_len("hello STX"), 9);
        assert_eq!(c.emittable_len("caf é"), 4);
        assert_eq!(c.emittable_len("STO"), 0);

        let (_, m, streamed) = run(&c, &["hel", "lo S", "T", "x"]);
        assert_eq!(m, None);
        assert_eq!(streamed, "hello STx");
    }

    #[test]
    fn multibyte_text_never_split() {
        let c = StopChecker::new(["😀!"]);
        let text = "ab😀";
        // Region start falls inside the emoji: must be floored to a char boundary.
        assert_eq!(c.check(text, 1), None);
        assert_eq!(c.check("ab😀!", 1).map(|m| m.truncate_at), Some(2));
        assert_eq!(c.emittable_len(text), 2);
    }

    proptest::proptest! {
        /// Random text split into random deltas: the streamed result equals truncating the
        /// whole text before the first occurrence of the stop string, and what was streamed
        /// before the stop is never more than the final text.
        #[test]
        fn random_splits_match_whole_text_search(
            text in "[ab\u{e9}]{0,30}",
            stop in "[ab\u{e9}]{1,4}",
            other in "[ab\u{e9}]{1,3}",
            cuts in proptest::collection::vec(0usize..40, 0..10),
        ) {
            let chars: Vec<(usize, char)> = text.char_indices().collect();
            let mut bounds: Vec<usize> = cuts
                .iter()
                .filter_map(|&c| chars.get(c).map(|&(i, _)| i))
                .collect();
            bounds.push(0);
            bounds.push(text.len());
            bounds.sort_unstable();
            bounds.dedup();
            let deltas: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();

            let single = StopChecker::new([stop.clone()]);
            let (out, m, _) = run(&single, &deltas);
            let expected = text.find(stop.as_str()).map_or(text.as_str(), |i| &text[..i]);
            proptest::prop_assert_eq!(out.as_str(), expected);
            proptest::prop_assert_eq!(m.is_some(), text.contains(stop.as_str()));

            let two = StopChecker::new([stop.clone(), other.clone()]);
            let (out, _, streamed) = run(&two, &deltas);
            proptest::prop_assert!(out.starts_with(&streamed));
            proptest::prop_assert!(!out.contains(stop.as_str()) && !out.contains(other.as_str()));
        }
    }

    #[test]
    fn with_detokenizer_across_token_boundaries() {
        let tok = tokenizer();
        let ids = tok
            .encode("the answer is 中文 and then ###END### ignored", false)
            .unwrap();
        let checker = StopChecker::new(["###END###"]);
        let mut detok = IncrementalDetokenizer::new(&[], true);
        let mut text = String::new();
        let mut hit = None;
        let mut deltas_seen = 0;
        for &id in &ids {
            let delta = detok.push(&tok, id).unwrap();
            text.push_str(&delta);
            if !delta.is_empty() {
                deltas_seen += 1;
            }
            if let Some(m) = checker.check(&text, delta.len()) {
                text.truncate(m.truncate_at);
                hit = Some(m);
                break;
            }
        }
        assert!(deltas_seen > 3);
        assert_eq!(hit.unwrap().stop, "###END###");
        assert_eq!(text, "the answer is 中文 and then ");
    }
}
