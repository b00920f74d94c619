//! Every constraint kind compiled against a byte-level vocabulary and driven token by
//! token, as the scheduler drives it: allowed tokens pass, others are refused, the end is
//! reported, bad specs are refused with a message, and the cache serves repeats.

use std::sync::Arc;

use pyengine_grammar::{ConstraintKind, ConstraintSpec, GrammarCompiler, GrammarError, Vocabulary};
use pyengine_sched::constraint::{Advance, ConstraintState};
use pyengine_sched::Constraint;

const EOS: u32 = 300;

/// Tokens 0..256 are single bytes, then some multi-byte tokens, EOS = 300, 320 ids.
fn compiler() -> GrammarCompiler {
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for w in ["true", "false", "\":", "{\"", "\"}", "ab", "abc", "yes"] {
        words.push(w.as_bytes().to_vec());
    }
    words.resize(EOS as usize, Vec::new());
    words.push(b"<|eos|>".to_vec());
    GrammarCompiler::new(Vocabulary::new(words, &[], &[EOS], 320).unwrap(), 8).unwrap()
}

fn spec(kind: ConstraintKind, text: &str) -> ConstraintSpec {
    ConstraintSpec::new(kind, text)
}

fn allowed(m: &mut dyn ConstraintState) -> Vec<u32> {
    let mut mask = vec![0u32; 10];
    assert!(m.fill_mask(&mut mask), "a dead end");
    (0..320).filter(|&t| mask[t as usize / 32] & (1 << (t % 32)) != 0).collect()
}

/// Feeds `text` byte by byte (each byte must be allowed); returns the last advance.
fn feed(m: &mut dyn ConstraintState, text: &str) -> Advance {
    let mut last = Advance::Continue;
    for &b in text.as_bytes() {
        assert!(allowed(m).contains(&(b as u32)), "{:?} not allowed in {text:?}", b as char);
        last = m.advance(b as u32).unwrap();
    }
    last
}

#[test]
fn json_schema_allows_valid_json_only_and_ends_itself() {
    let c = compiler();
    let mut s = spec(
        ConstraintKind::Json,
        r#"{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"boolean"}},"required":["a","b"]}"#,
    );
    s.json.disable_any_whitespace = true;
    let g = c.compile(&s).unwrap().grammar;
    let mut m = g.start();
    assert_eq!(feed(m.as_mut(), r#"{"a":12,"b":"#), Advance::Continue);
    assert!(!allowed(m.as_mut()).contains(&(b'"' as u32)), "b is a boolean");
    assert!(m.advance(b'"' as u32).is_err());
    let mut m = g.start();
    assert_eq!(feed(m.as_mut(), r#"{"a":12,"b":true}"#), Advance::Complete { eos: false });
}

#[test]
fn json_object_and_whitespace_options() {
    let c = compiler();
    let g = c.compile(&spec(ConstraintKind::JsonObject, "")).unwrap().grammar;
    let mut m = g.start();
    assert!(!allowed(m.as_mut()).contains(&(b'[' as u32)), "an object, not an array");
    assert_eq!(feed(m.as_mut(), "{ \"k\" : [1, 2] }"), Advance::Complete { eos: false });
    let mut compact = spec(ConstraintKind::JsonObject, "");
    compact.json.disable_any_whitespace = true;
    let mut m = c.compile(&compact).unwrap().grammar.start();
    feed(m.as_mut(), "{");
    assert!(!allowed(m.as_mut()).contains(&(b' ' as u32)));
}

#[test]
fn regex_ends_with_eos_where_it_may_go_on() {
    let c = compiler();
    let g = c.compile(&spec(ConstraintKind::Regex, "ab+")).unwrap().grammar;
    let mut m = g.start();
    feed(m.as_mut(), "ab");
    let next = allowed(m.as_mut());
    assert!(next.contains(&(b'b' as u32)) && next.contains(&EOS) && !next.contains(&(b'a' as u32)));
    assert_eq!(m.advance(EOS).unwrap(), Advance::Complete { eos: true });
    let mut m = c.compile(&spec(ConstraintKind::Regex, "ab?c")).unwrap().grammar.start();
    assert_eq!(feed(m.as_mut(), "ac"), Advance::Complete { eos: false });
}

#[test]
fn choice_is_exactly_one_of_the_strings_special_characters_included() {
    let c = compiler();
    let g = c.compile(&spec(ConstraintKind::Choice, r#"["yes", "no", "a.b*"]"#)).unwrap().grammar;
    let mut m = g.start();
    let first = allowed(m.as_mut());
    assert!(
        first.contains(&(b'y' as u32)) && first.contains(&(b'n' as u32)) && !first.contains(&(b'x' as u32))
    );
    assert!(first.contains(&263), "the multi-byte token \"yes\" is allowed");
    assert_eq!(m.advance(263).unwrap(), Advance::Complete { eos: false });
    let mut m = g.start();
    assert_eq!(feed(m.as_mut(), "a.b*"), Advance::Complete { eos: false });
}

#[test]
fn lark_grammar() {
    let c = compiler();
    let lark = "start: item (\",\" item)*\nitem: /[0-9]+/ | \"x\"";
    let g = c.compile(&spec(ConstraintKind::Grammar, lark)).unwrap().grammar;
    let mut m = g.start();
    feed(m.as_mut(), "12,x,7");
    assert!(allowed(m.as_mut()).contains(&EOS));
    assert!(m.advance(b';' as u32).is_err());
}

#[test]
fn bad_specs_are_refused_naming_the_kind_and_the_problem() {
    let c = compiler();
    let cases = [
        (ConstraintKind::Regex, "(ab", "regex"),
        (ConstraintKind::Json, "{not json", "not valid JSON"),
        (ConstraintKind::Json, r#"{"type": "strin"}"#, "json"),
        (ConstraintKind::Json, r#"{"type":"string","minLength":5,"maxLength":2}"#, "json"),
        (ConstraintKind::Grammar, "start: \"a\" ) (", "grammar"),
        (ConstraintKind::Grammar, "start: undefined_rule", "grammar"),
        (ConstraintKind::Choice, "[]", "no choices"),
    ];
    for (kind, text, needle) in cases {
        match c.compile(&spec(kind, text)) {
            Err(e @ GrammarError::InvalidConstraint { .. }) => {
                let msg = e.to_string();
                assert!(msg.starts_with(&format!("invalid {}", kind.name())), "{msg}");
                assert!(msg.contains(needle), "{text:?}: {msg}");
            }
            Err(e) => panic!("{text:?}: wrong error {e}"),
            Ok(_) => panic!("{text:?} compiled"),
        }
    }
    assert_eq!(c.stats().failed, cases.len() as u64);
    assert_eq!(c.stats().cached_grammars, 0, "failures are not cached");
}

#[test]
fn the_same_spec_is_compiled_once_and_the_cache_is_bounded() {
    let c = compiler();
    let s = spec(ConstraintKind::Regex, "[a-z]{1,4}");
    assert!(c.cached(&s).is_none());
    let first = c.compile(&s).unwrap();
    assert!(Arc::ptr_eq(&c.cached(&s).unwrap(), &first.grammar));
    let again = c.compile(&s).unwrap();
    assert!(!first.cached && again.cached);
    assert!(Arc::ptr_eq(&first.grammar, &again.grammar));
    let mut other = s.clone();
    other.json.disable_any_whitespace = true; // options are part of the key
    assert!(!c.compile(&other).unwrap().cached);
    for i in 0..20 {
        c.compile(&spec(ConstraintKind::Regex, &format!("x{{{i}}}"))).unwrap();
    }
    let stats = c.stats();
    assert_eq!((stats.compiled, stats.cache_hits, stats.cached_grammars), (22, 1, 8));
}

#[test]
fn matchers_are_independent_and_forks_continue_alone() {
    let c = compiler();
    let g = c.compile(&spec(ConstraintKind::Regex, "(ab|ac)d")).unwrap().grammar;
    let mut one = g.start();
    let mut two = g.start();
    feed(one.as_mut(), "a");
    let mut fork = one.fork();
    feed(one.as_mut(), "b");
    feed(fork.as_mut(), "c");
    assert_eq!(feed(two.as_mut(), "acd"), Advance::Complete { eos: false });
    assert_eq!(feed(one.as_mut(), "d"), Advance::Complete { eos: false });
    assert_eq!(g.mask_words(), 10);
}

/// Random walks through a bounded schema always end, in JSON that parses and fits it.
#[test]
fn random_walks_through_a_bounded_schema_end_in_valid_json() {
    let c = compiler();
    let mut s = spec(
        ConstraintKind::Json,
        r#"{"type":"object","properties":{"name":{"type":"string","maxLength":5},
            "tags":{"type":"array","items":{"enum":["x","y"]},"maxItems":3},
            "ok":{"type":"boolean"}},"required":["name","tags","ok"],"additionalProperties":false}"#,
    );
    s.json.disable_any_whitespace = true;
    let g = c.compile(&s).unwrap().grammar;
    let mut seed = 12345u64;
    for _ in 0..50 {
        let mut m = g.start();
        let mut text = Vec::new();
        for step in 0.. {
            assert!(step < 200, "the walk did not end");
            let options = allowed(m.as_mut());
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let t = options[(seed >> 33) as usize % options.len()];
            match m.advance(t).unwrap() {
                Advance::Continue => text.push(t),
                Advance::Complete { eos } => {
                    if !eos {
                        text.push(t);
                    }
                    break;
                }
            }
        }
        let bytes: Vec<u8> = text
            .iter()
            .flat_map(|&t| match t {
                0..=255 => vec![t as u8],
                256 => b"true".to_vec(),
                257 => b"false".to_vec(),
                258 => b"\":".to_vec(),
                259 => b"{\"".to_vec(),
                260 => b"\"}".to_vec(),
                261 => b"ab".to_vec(),
                262 => b"abc".to_vec(),
                263 => b"yes".to_vec(),
                _ => panic!("token {t} has no bytes"),
            })
            .collect();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert!(v["name"].as_str().unwrap().chars().count() <= 5);
        assert!(v["tags"].as_array().unwrap().len() <= 3);
        assert!(v["ok"].is_boolean());
        assert_eq!(v.as_object().unwrap().len(), 3);
    }
}
