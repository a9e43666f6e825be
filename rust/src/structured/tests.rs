//! The grammar engine over the test byte-level tokenizer (256 byte tokens, "he", `<|eot|>`):
//! masks allow exactly the continuations of the grammar, formats compile once, drafts are cut
//! where the grammar refuses them, rollback restores a mask, forced tokens are the grammar's.

use super::*;
use crate::testutil::byte_level_tokenizer;
use tokenizers::Tokenizer;

const PADDING: usize = 3; // model ids past the tokenizer's

struct Setup {
    tok: Tokenizer,
    grammars: Grammars,
    eot: u32,
}

fn setup() -> Setup {
    let tok = byte_level_tokenizer();
    let eot = tok.token_to_id("<|eot|>").unwrap();
    let vocab = tok.get_vocab_size(true) + PADDING;
    let env = token_env(&tok, vocab, &[eot]).unwrap();
    let grammars = Grammars::new(&env, vocab).unwrap();
    Setup { tok, grammars, eot }
}

fn format(text: &str) -> ResponseFormat {
    ResponseFormat::parse(text).unwrap()
}

/// The id of each byte of `text` (one token per byte, merges aside).
fn ids(s: &Setup, text: &str) -> Vec<u32> {
    text.bytes().map(|b| byte_id(s, b)).collect()
}

fn byte_id(s: &Setup, b: u8) -> u32 {
    (0..256u32)
        .find(|&id| s.tok.decode(&[id], false).unwrap().as_bytes() == [b])
        .unwrap()
}

fn allowed(s: &Setup, m: &mut RowMatcher) -> Vec<u32> {
    let mut words = vec![0u32; s.grammars.mask_words()];
    m.fill_mask(&mut words).unwrap();
    (0..words.len() as u32 * 32)
        .filter(|&t| words[t as usize / 32] >> (t % 32) & 1 == 1)
        .collect()
}

fn allowed_bytes(s: &Setup, m: &mut RowMatcher) -> Vec<u8> {
    let mut out: Vec<u8> = allowed(s, m)
        .into_iter()
        .filter(|&t| t != s.eot)
        .map(|t| s.tok.decode(&[t], false).unwrap())
        .filter(|t| t.len() == 1)
        .map(|t| t.as_bytes()[0])
        .collect();
    out.sort();
    out
}

#[test]
fn a_choice_allows_only_its_options_and_ends_with_eos_allowed() {
    let s = setup();
    let mut m = s
        .grammars
        .matcher(&format(
            r#"{"type": "choice", "choices": ["red", "green"]}"#,
        ))
        .unwrap();
    assert_eq!(allowed_bytes(&s, &mut m), b"gr".to_vec());
    m.consume(&ids(&s, "gre")).unwrap();
    assert_eq!(allowed_bytes(&s, &mut m), b"e".to_vec());
    m.consume(&ids(&s, "en")).unwrap();
    assert!(m.is_accepting() && m.is_stopped());
    assert_eq!(allowed(&s, &mut m), vec![s.eot]); // a completed grammar allows only EOS
}

#[test]
fn a_json_schema_row_follows_the_schema_byte_by_byte() {
    let s = setup();
    let schema = r#"{"type": "json_schema", "json_schema": {"name": "p", "strict": true, "schema":
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
         "additionalProperties": false}}}"#;
    let mut m = s.grammars.matcher(&format(schema)).unwrap();
    let text = r#"{"n":42}"#;
    for (i, b) in text.bytes().enumerate() {
        let ok = allowed_bytes(&s, &mut m);
        assert!(
            ok.contains(&b),
            "byte {i} {:?} not in {:?}",
            b as char,
            String::from_utf8_lossy(&ok)
        );
        assert!(!ok.contains(&b'x'), "x allowed at {i}");
        m.consume(&[byte_id(&s, b)]).unwrap();
    }
    assert!(m.is_accepting());
}

#[test]
fn ids_past_the_tokenizer_and_specials_are_never_allowed_in_text() {
    let s = setup();
    let mut m = s
        .grammars
        .matcher(&format(r#"{"type": "regex", "pattern": ".*"}"#))
        .unwrap();
    let ok = allowed(&s, &mut m);
    let vocab = s.tok.get_vocab_size(true) as u32;
    assert!(ok.iter().all(|&t| t < vocab), "padding ids allowed");
    assert!(ok.contains(&byte_id(&s, b'a')));
    assert!(ok.contains(&s.eot)); // ".*" may end at once: EOS is allowed
}

#[test]
fn each_distinct_format_compiles_once() {
    let s = setup();
    let a = r#"{"type": "regex", "pattern": "(yes|no)"}"#;
    for _ in 0..100 {
        s.grammars.matcher(&format(a)).unwrap();
    }
    s.grammars
        .matcher(&format(r#"{"type": "regex", "pattern": "(yes|maybe)"}"#))
        .unwrap();
    assert_eq!(s.grammars.compiled(), 2);
}

#[test]
fn drafts_are_cut_where_the_grammar_refuses_them_and_rollback_restores_the_mask() {
    let s = setup();
    let mut m = s
        .grammars
        .matcher(&format(r#"{"type": "regex", "pattern": "abc(d|e)f"}"#))
        .unwrap();
    assert_eq!(m.valid_prefix(&ids(&s, "abcxf")), 3);
    assert_eq!(m.valid_prefix(&ids(&s, "abcef")), 5);
    m.consume(&ids(&s, "ab")).unwrap();
    let before = allowed(&s, &mut m);
    m.consume(&ids(&s, "cd")).unwrap();
    m.rollback(2).unwrap();
    assert_eq!(allowed(&s, &mut m), before);
}

#[test]
fn forced_tokens_are_the_only_continuation() {
    let s = setup();
    let mut m = s
        .grammars
        .matcher(&format(r#"{"type": "regex", "pattern": "abc(d|e)"}"#))
        .unwrap();
    let forced = m.forced();
    assert_eq!(s.tok.decode(&forced, false).unwrap(), "abc");
    m.consume(&forced).unwrap();
    assert!(m.forced().is_empty());
}

#[test]
fn bad_formats_are_refused_with_the_reason() {
    let s = setup();
    let cases = [
        ("[1]", "must be a JSON object"),
        (r#"{"type": "xml"}"#, "expected text, json_schema"),
        (r#"{"type": "regex"}"#, "\"pattern\""),
        (r#"{"type": "choice", "choices": []}"#, "non-empty list"),
        (
            r#"{"type": "json_schema", "json_schema": {"schema": 3}}"#,
            "must be a JSON object",
        ),
        (
            r#"{"type": "json_object", "extra": 1}"#,
            "unknown key \"extra\"",
        ),
    ];
    for (text, want) in cases {
        let err = ResponseFormat::parse(text).unwrap_err();
        assert!(err.contains(want), "{text}: {err}");
    }
    let bad_regex = format(r#"{"type": "regex", "pattern": "(unclosed"}"#);
    let err = s.grammars.matcher(&bad_regex).err().unwrap();
    assert!(err.contains("does not compile"), "{err}");
    let bad_lark = format(r#"{"type": "grammar", "lark": "start: undefined_rule"}"#);
    assert!(s.grammars.matcher(&bad_lark).is_err());
}

#[test]
fn a_sentencepiece_vocabulary_maps_spaces_and_byte_fallback() {
    assert_eq!(
        token_env::from_sentencepiece_for_tests("\u{2581}the"),
        b" the".to_vec()
    );
    assert_eq!(
        token_env::from_sentencepiece_for_tests("<0x0A>"),
        vec![b'\n']
    );
    assert_eq!(
        token_env::from_sentencepiece_for_tests("<0xZZ>"),
        b"<0xZZ>".to_vec()
    );
}

#[test]
fn a_format_no_text_matches_is_refused_in_words() {
    let s = setup();
    let cases = [
        r#"{"type": "grammar", "lark": "start: start"}"#,
        r#"{"type": "grammar", "lark": "start: \"a\" start"}"#,
        r#"{"type": "regex", "pattern": "[^\\s\\S]"}"#,
        r##"{"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/a",
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}}"##,
        r##"{"type": "json_schema", "json_schema": {"schema": {"anyOf": [{"$ref": "#"}]}}}"##,
    ];
    for text in cases {
        let err = s.grammars.matcher(&format(text)).err().unwrap();
        assert!(err.contains("matches no text"), "{text}: {err}");
        assert!(err.len() < 300 && !err.contains('\n'), "{err}");
    }
}

#[test]
fn a_format_matching_only_the_empty_text_only_ends_until_it_consumes() {
    let s = setup();
    let mut m = s
        .grammars
        .matcher(&format(r#"{"type": "regex", "pattern": "a{0}"}"#))
        .unwrap();
    assert!(m.only_ends());
    assert_eq!(allowed(&s, &mut m), vec![s.eot]);
    let mut other = s
        .grammars
        .matcher(&format(r#"{"type": "regex", "pattern": "a?"}"#))
        .unwrap();
    assert!(!other.only_ends());
    other.consume(&ids(&s, "a")).unwrap();
    assert!(other.only_ends()); // completed
}

#[test]
fn thousands_of_alternatives_compile_and_more_than_the_bound_are_refused() {
    let s = setup();
    let words: Vec<String> = (0..MOST_ALTERNATIVES).map(|i| format!("w{i}")).collect();
    let choice = |w: &[String]| ResponseFormat::Choice(w.to_vec());
    let mut m = s.grammars.matcher(&choice(&words)).unwrap();
    m.consume(&ids(&s, "w9999")).unwrap();
    assert!(m.is_accepting());
    let mut more = words.clone();
    more.push("x".into());
    let err = s.grammars.matcher(&choice(&more)).err().unwrap();
    assert!(err.contains("offers 10001 alternatives"), "{err}");
    // A grammar's bound is on parser items (its alternatives plus the rules around them), met
    // at compile time or where a row reaches that point: either way one short sentence.
    let many = (0..MOST_ALTERNATIVES + 100).map(|i| format!("\"w{i}\""));
    let lark = ResponseFormat::Lark(format!("start: {}", many.collect::<Vec<_>>().join(" | ")));
    let err = match s.grammars.matcher(&lark) {
        Err(e) => e,
        Ok(mut m) => {
            let mut words = vec![0u32; s.grammars.mask_words()];
            assert!(m.fill_mask(&mut words).is_err() || m.consume(&ids(&s, "w1")).is_err());
            m.failure().unwrap()
        }
    };
    assert!(
        err.contains("alternatives at one point") && err.len() < 300,
        "{err}"
    );
}

#[test]
fn json_whitespace_is_bounded_unless_the_schema_sets_its_own() {
    let s = setup();
    let nl = byte_id(&s, b'\n');
    let schema = |x: &str| {
        format!(
            r#"{{"type": "json_schema", "json_schema": {{"schema": {{"type": "object"{x}}}}}}}"#
        )
    };
    let after_two_newlines = |text: &str| {
        let mut m = s.grammars.matcher(&format(text)).unwrap();
        m.consume(&ids(&s, "{\n")).unwrap();
        allowed(&s, &mut m).contains(&nl)
    };
    assert!(!after_two_newlines(&schema("")));
    assert!(after_two_newlines(&schema(
        r#", "x-guidance": {"whitespace_flexible": true}"#
    )));
    assert!(after_two_newlines(&schema(
        r#", "x-guidance": {"whitespace_pattern": "\\n*"}"#
    )));
    let mut compact = s
        .grammars
        .matcher(&format(&schema(
            r#", "x-guidance": {"whitespace_flexible": false}"#,
        )))
        .unwrap();
    compact.consume(&ids(&s, "{")).unwrap();
    assert!(!allowed(&s, &mut compact).contains(&nl));
    let mut object = s
        .grammars
        .matcher(&format(r#"{"type": "json_object"}"#))
        .unwrap();
    object.consume(&ids(&s, "{\n")).unwrap();
    assert!(!allowed(&s, &mut object).contains(&nl));
}
