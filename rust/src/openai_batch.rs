//! OpenAI Batch input: one JSON request per line, `{custom_id, method, url, body}`, for
//! `/v1/chat/completions` (body.messages) and `/v1/completions` (body.prompt, one string);
//! each line's url is its own, so one file may mix them.
//!
//! A line becomes a request whose id is its `custom_id`, whose prompt is its messages (rendered
//! with the chat template) or its prompt text, and whose sampling parameters are the job's with
//! the body's overriding them (the keys openai_keys.rs applies). Anything wrong with a line
//! (not JSON, a missing field, a value out of range, a key or value eaglebatch would not apply)
//! makes that line an error row whose message names the line number; it never fails the job. Blank lines are not
//! requests (and not counted). A UTF-8 byte order mark opening the file is not part of line 1,
//! and a line may end in CRLF (the `\r` is JSON whitespace).

use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value};

use crate::chat_template::Message;
use crate::error::{Error, Result};
use crate::openai_keys::{check_body, check_message_key, shown, Body, Endpoint};
pub use crate::openai_keys::{CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL};
use crate::pooled::EmbedLine;
use crate::sampling_params::{held_f32, row_seed, SamplingParams, MAX_SAMPLES};
use crate::structured::ResponseFormat;

/// What a line asks to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Chat(Vec<Message>),
    Text(String),
    /// `/v1/embeddings`: the inputs (one embedding each) and the line's options.
    Inputs(Vec<String>, EmbedLine),
}

/// One parsed line: its custom_id and endpoint when it has them, and its prompt and sampling
/// or its error.
#[derive(Debug)]
pub struct BatchLine {
    pub custom_id: Option<String>,
    pub endpoint: Option<Endpoint>,
    pub request: std::result::Result<(Prompt, Arc<SamplingParams>), String>,
}

/// What an OpenAI Batch input's lines ask, read before any work: its requests (non-blank
/// lines), the first line's served endpoint (the default of parts without an `endpoint`) and
/// whether any line is a chat request (then its messages need the chat template).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Survey {
    pub requests: u64,
    pub first: Option<Endpoint>,
    pub chat: bool,
    /// Set by the caller: the job embeds (`task: embed` serves `/v1/embeddings` lines only,
    /// the other tasks the generation endpoints only).
    pub embed: bool,
}

/// Adds the lines of JSONL file `path` to `seen`, streaming it, and returns its requests. A
/// line is parsed only while what it may tell is unknown: until one names a served endpoint,
/// then only lines holding "chat" until one is a chat request.
pub fn survey_requests(
    path: &Path,
    storage: &crate::storage::StorageSettings,
    seen: &mut Survey,
) -> Result<u64> {
    let file = crate::storage::Source::open(path, storage)?.into_read();
    let mut n = 0;
    for (i, line) in std::io::BufReader::new(file).split(b'\n').enumerate() {
        let line = line.map_err(|e| Error::user(format!("{}: {e}", path.display())))?;
        let line = without_bom(&line, i);
        if is_blank(line) {
            continue;
        }
        n += 1;
        let may_chat = !seen.chat && line.windows(4).any(|w| w == b"chat");
        if seen.first.is_none() || may_chat {
            let served = |e: &Endpoint| (*e == Endpoint::Embeddings) == seen.embed;
            let endpoint = line_endpoint(line).filter(served);
            seen.first = seen.first.or(endpoint);
            seen.chat = endpoint == Some(Endpoint::Chat);
        }
    }
    seen.requests += n;
    Ok(n)
}

/// The served endpoint a line's `url` names (None: not JSON, no url, or another one).
fn line_endpoint(line: &[u8]) -> Option<Endpoint> {
    let v: Value = serde_json::from_slice(line).ok()?;
    Endpoint::of(v.get("url")?.as_str()?)
}

/// The UTF-8 byte order mark, which some editors write at the start of a text file.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Line `index` (0-based) of a file without the byte order mark that may open the file (only
/// line 0 can have one; elsewhere the bytes are the line's own).
pub fn without_bom(line: &[u8], index: usize) -> &[u8] {
    match index {
        0 => line.strip_prefix(BOM).unwrap_or(line),
        _ => line,
    }
}

/// Whether a line (bytes, maybe not UTF-8) holds only whitespace: not a request.
pub fn is_blank(line: &[u8]) -> bool {
    line.iter().all(u8::is_ascii_whitespace)
}

/// Parses line `line_no` (1-based) for a job whose sampling is `job` with `n` samples per row.
pub fn parse_line(text: &str, line_no: u64, job: &Arc<SamplingParams>, n: usize) -> BatchLine {
    let at = |e: String| format!("line {line_no}: {e}");
    let obj = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(o)) => o,
        Ok(_) => return failed(None, at("not a JSON object".into())),
        Err(e) => return failed(None, at(format!("not valid JSON ({e})"))),
    };
    let custom_id = obj
        .get("custom_id")
        .and_then(Value::as_str)
        .map(str::to_string);
    let endpoint = obj
        .get("url")
        .and_then(Value::as_str)
        .and_then(Endpoint::of);
    let request = parse_request(&obj, endpoint, job, n).map_err(at);
    let request = match custom_id {
        None if request.is_ok() => Err(at("custom_id is missing or not a string".into())),
        _ => request,
    };
    BatchLine {
        custom_id,
        endpoint,
        request,
    }
}

fn failed(custom_id: Option<String>, msg: String) -> BatchLine {
    BatchLine {
        custom_id,
        endpoint: None,
        request: Err(msg),
    }
}

fn parse_request(
    obj: &Map<String, Value>,
    endpoint: Option<Endpoint>,
    job: &Arc<SamplingParams>,
    n: usize,
) -> std::result::Result<(Prompt, Arc<SamplingParams>), String> {
    if let Some(m) = obj.get("method").filter(|m| m.as_str() != Some("POST")) {
        return Err(format!("method must be \"POST\", got {m}"));
    }
    let Some(e) = endpoint else {
        let url = obj.get("url").map_or("nothing".to_string(), shown);
        return Err(format!(
            "url must be \"{CHAT_URL}\", \"{COMPLETIONS_URL}\" or \"{EMBEDDINGS_URL}\", got {url}"
        ));
    };
    let url = e.url();
    let Some(Value::Object(body)) = obj.get("body") else {
        return Err("body is missing or not an object".into());
    };
    let samples = body.get("n").and_then(Value::as_u64).unwrap_or(n as u64);
    check_body(&Body { body, n: samples }, e, url)?;
    let prompt = match e {
        Endpoint::Chat => Prompt::Chat(messages(body)?),
        Endpoint::Completions => match body.get("prompt") {
            Some(Value::String(s)) => Prompt::Text(s.clone()),
            _ => return Err("body.prompt must be one string".into()),
        },
        Endpoint::Embeddings => return embedding_request(body, job),
    };
    let params = body_sampling(body, job, e == Endpoint::Chat)?;
    Ok((prompt, params))
}

/// An embeddings line: its inputs (a string, or a list of 1 to MAX_SAMPLES non-empty strings:
/// the row's samples, one embedding each), `dimensions` and `encoding_format`.
fn embedding_request(
    body: &Map<String, Value>,
    job: &Arc<SamplingParams>,
) -> std::result::Result<(Prompt, Arc<SamplingParams>), String> {
    let bad = || "body.input must be a string or a list of strings".to_string();
    let inputs: Vec<String> = match body.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(list)) => list
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(bad))
            .collect::<std::result::Result<_, _>>()?,
        _ => return Err(bad()),
    };
    if inputs.is_empty() || inputs.len() > MAX_SAMPLES {
        return Err(format!(
            "body.input has {} inputs; 1 to {MAX_SAMPLES} are allowed",
            inputs.len()
        ));
    }
    if let Some(j) = inputs.iter().position(String::is_empty) {
        return Err(format!("body.input[{j}] is empty"));
    }
    let dimensions = match uint(body, "dimensions")? {
        Some(0) => return Err("body.dimensions must be at least 1".into()),
        d => d.map_or(0, |d| usize::try_from(d).unwrap_or(usize::MAX)),
    };
    let base64 = match given(body, "encoding_format") {
        None => false,
        Some(v) if v == "float" => false,
        Some(v) if v == "base64" => true,
        Some(v) => {
            return Err(format!(
                "body.encoding_format must be \"float\" or \"base64\", got {}",
                shown(v)
            ))
        }
    };
    let mut p = job.as_ref().clone();
    p.n = inputs.len();
    let line = EmbedLine { dimensions, base64 };
    Ok((Prompt::Inputs(inputs, line), Arc::new(p)))
}

/// body.messages as chat-template messages: role, content (a string, text parts, or null for
/// an assistant's: no text) and name when given; other message keys only empty.
fn messages(body: &Map<String, Value>) -> std::result::Result<Vec<Message>, String> {
    let Some(Value::Array(list)) = body.get("messages") else {
        return Err("body.messages must be a list".into());
    };
    if list.is_empty() {
        return Err("body.messages is empty".into());
    }
    list.iter()
        .enumerate()
        .map(|(j, m)| message(j, m))
        .collect()
}

fn message(j: usize, m: &Value) -> std::result::Result<Message, String> {
    let Some(m) = m.as_object() else {
        return Err(format!("body.messages[{j}] must be an object"));
    };
    for (k, v) in m {
        check_message_key(j, k, v)?;
    }
    let role = m.get("role").and_then(Value::as_str);
    let role = role.ok_or_else(|| format!("body.messages[{j}].role must be a string"))?;
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_parts(parts, j)?,
        None | Some(Value::Null) if role == "assistant" => String::new(),
        _ => {
            return Err(format!(
                "body.messages[{j}].content must be a string or parts"
            ))
        }
    };
    let mut out = vec![
        ("role".to_string(), Some(role.to_string())),
        ("content".to_string(), Some(content)),
    ];
    match m.get("name") {
        None | Some(Value::Null) => {}
        Some(Value::String(name)) => out.push(("name".to_string(), Some(name.clone()))),
        Some(v) => {
            return Err(format!(
                "body.messages[{j}].name must be a string, got {}",
                shown(v)
            ))
        }
    }
    Ok(out)
}

fn text_parts(parts: &[Value], j: usize) -> std::result::Result<String, String> {
    let mut text = String::new();
    for p in parts {
        match (
            p.get("type").and_then(Value::as_str),
            p.get("text").and_then(Value::as_str),
        ) {
            (Some("text"), Some(t)) => text.push_str(t),
            _ => {
                return Err(format!(
                    "body.messages[{j}].content: only text parts are supported"
                ))
            }
        }
    }
    Ok(text)
}

type Parsed<T> = std::result::Result<Option<T>, String>;

/// body.k when present and not null.
fn given<'a>(body: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    body.get(k).filter(|v| !v.is_null())
}

fn uint(body: &Map<String, Value>, k: &str) -> Parsed<u64> {
    given(body, k)
        .map(|v| {
            v.as_u64()
                .ok_or_else(|| format!("body.{k} must be an integer >= 0, got {}", shown(v)))
        })
        .transpose()
}

fn int(body: &Map<String, Value>, k: &str) -> Parsed<i64> {
    given(body, k)
        .map(|v| {
            v.as_i64()
                .ok_or_else(|| format!("body.{k} must be a 64-bit integer, got {}", shown(v)))
        })
        .transpose()
}

fn num(body: &Map<String, Value>, k: &str) -> Parsed<f32> {
    given(body, k)
        .map(|v| match v.as_f64() {
            Some(x) => held_f32(k, x).map_err(|e| format!("body.{k}: {e}")),
            None => Err(format!("body.{k} must be a number, got {}", shown(v))),
        })
        .transpose()
}

fn flag(body: &Map<String, Value>, k: &str) -> Parsed<bool> {
    given(body, k)
        .map(|v| {
            v.as_bool()
                .ok_or_else(|| format!("body.{k} must be true or false, got {}", shown(v)))
        })
        .transpose()
}

fn token_ids(body: &Map<String, Value>, k: &str) -> Parsed<Vec<u32>> {
    let bad = |v: &Value| format!("body.{k} must be a list of token ids, got {}", shown(v));
    given(body, k)
        .map(|v| {
            let list = v.as_array().ok_or_else(|| bad(v))?;
            list.iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| bad(v))
                })
                .collect()
        })
        .transpose()
}

/// The job's parameters with the body's sampling keys applied, checked (vLLM's conventions:
/// `top_k: -1` is off, `seed: -1` no seed of the line's own).
fn body_sampling(
    body: &Map<String, Value>,
    job: &Arc<SamplingParams>,
    chat: bool,
) -> std::result::Result<Arc<SamplingParams>, String> {
    let mut p = job.as_ref().clone();
    let to_usize = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    if let Some(v) = uint(body, "max_completion_tokens")?.or(uint(body, "max_tokens")?) {
        p.max_new_tokens = to_usize(v);
    }
    if let Some(v) = uint(body, "min_tokens")? {
        p.min_new_tokens = to_usize(v);
    }
    if let Some(v) = int(body, "top_k")? {
        let v = if v == -1 { 0 } else { v };
        p.top_k = i32::try_from(v).map_err(|_| format!("body.top_k {v} is out of range"))?;
    }
    if let Some(v) = int(body, "seed")? {
        p.seed = row_seed(v);
    }
    p.n = samples(body)?.unwrap_or(p.n);
    for (k, field) in [
        ("temperature", &mut p.temperature),
        ("top_p", &mut p.top_p),
        ("frequency_penalty", &mut p.frequency_penalty),
        ("presence_penalty", &mut p.presence_penalty),
        ("repetition_penalty", &mut p.repetition_penalty),
        ("min_p", &mut p.min_p),
    ] {
        *field = num(body, k)?.unwrap_or(*field);
    }
    for (k, field) in [
        ("ignore_eos", &mut p.ignore_eos),
        (
            "include_stop_str_in_output",
            &mut p.include_stop_str_in_output,
        ),
        ("skip_special_tokens", &mut p.skip_special_tokens),
    ] {
        *field = flag(body, k)?.unwrap_or(*field);
    }
    p.stop_token_ids = token_ids(body, "stop_token_ids")?.unwrap_or(p.stop_token_ids);
    p.stop = stop(body)?.unwrap_or(p.stop);
    p.logprobs = logprobs(body, chat)?.unwrap_or(p.logprobs);
    if let Some(v) = given(body, "response_format") {
        let format = ResponseFormat::of_request(v).map_err(|e| format!("body.{e}"))?;
        p.response_format = format.map(Arc::new);
    }
    p.check().map_err(|e| format!("body: {e}"))?;
    if p.n > 1 && p.temperature == 0.0 {
        return Err(format!(
            "body.n = {} needs a temperature above 0 (greedy samples would all be the same)",
            p.n
        ));
    }
    Ok(Arc::new(p))
}

/// `n`, in 1..=MAX_SAMPLES.
fn samples(body: &Map<String, Value>) -> Parsed<usize> {
    match uint(body, "n")? {
        Some(v) if v == 0 || v > MAX_SAMPLES as u64 => {
            Err(format!("body.n = {v} is out of range (1 to {MAX_SAMPLES})"))
        }
        v => Ok(v.map(|v| v as usize)),
    }
}

fn stop(body: &Map<String, Value>) -> std::result::Result<Option<Vec<String>>, String> {
    let bad = || "body.stop must be a string or a list of strings".to_string();
    match body.get("stop") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(nonempty(vec![s.clone()]))),
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(bad))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(|v| Some(nonempty(v))),
        Some(_) => Err(bad()),
    }
}

fn nonempty(v: Vec<String>) -> Vec<String> {
    v.into_iter().filter(|s| !s.is_empty()).collect()
}

/// The alternatives a line asks for: chat `logprobs: true` with `top_logprobs` (at least 1:
/// the chosen token's entry comes with its alternatives), completions `logprobs: K`.
fn logprobs(body: &Map<String, Value>, chat: bool) -> std::result::Result<Option<u32>, String> {
    let k = |v: &Value, key: &str| {
        v.as_u64()
            .and_then(|k| u32::try_from(k).ok())
            .ok_or_else(|| format!("body.{key} must be an integer >= 0, got {v}"))
    };
    match (chat, body.get("logprobs")) {
        (true, None | Some(Value::Null) | Some(Value::Bool(false))) => {
            match body.get("top_logprobs") {
                None | Some(Value::Null) => Ok(None),
                Some(v) if v.as_u64() == Some(0) => Ok(None),
                Some(v) => Err(format!(
                    "body.top_logprobs = {} needs body.logprobs: true",
                    shown(v)
                )),
            }
        }
        (false, None | Some(Value::Null)) => Ok(None),
        (true, Some(Value::Bool(true))) => match body.get("top_logprobs") {
            None | Some(Value::Null) => Ok(Some(1)),
            Some(v) => k(v, "top_logprobs").map(|k| Some(k.max(1))),
        },
        (true, Some(v)) => Err(format!("body.logprobs must be true or false, got {v}")),
        (false, Some(v)) => k(v, "logprobs").map(|k| (k > 0).then_some(k)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use std::path::PathBuf;

    fn job() -> Arc<SamplingParams> {
        let cfg = RunConfig::new(vec![], "p", PathBuf::new(), PathBuf::new());
        Arc::new(cfg.sampling_params())
    }

    fn chat(body: &str) -> BatchLine {
        let line = format!(
            r#"{{"custom_id": "a", "method": "POST", "url": "{CHAT_URL}", "body": {body}}}"#
        );
        parse_line(&line, 3, &job(), 1)
    }

    #[test]
    fn a_survey_counts_requests_and_finds_the_first_url_and_chat_lines() {
        let dir = crate::testutil::TempDir::new("survey");
        let line = |url: &str| format!(r#"{{"custom_id": "a", "url": "{url}", "body": {{}}}}"#);
        let write = |name: &str, lines: &[String]| {
            let path = dir.path().join(name);
            std::fs::write(&path, lines.join("\n")).unwrap();
            path
        };
        let a = write(
            "a.jsonl",
            &["not json".into(), line("/v1/embeddings"), " ".into()],
        );
        let b = write(
            "b.jsonl",
            &[line(COMPLETIONS_URL), line(CHAT_URL), line(COMPLETIONS_URL)],
        );
        let mut seen = Survey::default();
        let none = Default::default();
        assert_eq!(survey_requests(&a, &none, &mut seen).unwrap(), 2);
        assert_eq!((seen.first, seen.chat), (None, false));
        assert_eq!(survey_requests(&b, &none, &mut seen).unwrap(), 3);
        let want = Survey {
            requests: 5,
            first: Some(Endpoint::Completions),
            chat: true,
            embed: false,
        };
        assert_eq!(seen, want);
        // an embedding job's lines are /v1/embeddings requests only
        let mut embed = Survey {
            embed: true,
            ..Survey::default()
        };
        assert_eq!(survey_requests(&b, &none, &mut embed).unwrap(), 3);
        assert_eq!(embed.first, None);
    }

    #[test]
    fn a_bom_opening_the_file_and_crlf_endings_are_read() {
        let dir = crate::testutil::TempDir::new("bom");
        let path = dir.path().join("b.jsonl");
        let line = format!(
            r#"{{"custom_id": "a", "method": "POST", "url": "{COMPLETIONS_URL}", "body": {{"prompt": "x"}}}}"#
        );
        let text = format!("\u{feff}{line}\r\n\r\n{line}\r\n");
        std::fs::write(&path, text).unwrap();
        let mut seen = Survey::default();
        assert_eq!(
            survey_requests(&path, &Default::default(), &mut seen).unwrap(),
            2
        );
        assert_eq!(seen.first, Some(Endpoint::Completions));
        let first = format!("\u{feff}{line}\r");
        let bare = std::str::from_utf8(without_bom(first.as_bytes(), 0)).unwrap();
        let l = parse_line(bare, 1, &job(), 1);
        assert_eq!(l.custom_id.as_deref(), Some("a"), "{:?}", l.request);
        assert!(l.request.is_ok());
        // Only the file's first line loses a BOM: later, the bytes are the line's own.
        assert_eq!(without_bom(first.as_bytes(), 1), first.as_bytes());
        // A tiny float a 32-bit float loses is the line's error, not greedy decoding.
        let e = chat(r#"{"messages": [{"role": "user", "content": "x"}], "temperature": 1e-300}"#);
        assert!(e.request.unwrap_err().contains("body.temperature"));
    }

    #[test]
    fn a_chat_line_with_its_sampling() {
        let l = chat(
            r#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_tokens": 5, "temperature": 0.5, "stop": "x", "seed": 3, "logprobs": true,
                "top_logprobs": 2}"#,
        );
        assert_eq!(l.custom_id.as_deref(), Some("a"));
        let (prompt, p) = l.request.unwrap();
        let Prompt::Chat(m) = prompt else { panic!() };
        assert_eq!(m[0][1].1.as_deref(), Some("hi"));
        assert_eq!(
            (p.max_new_tokens, p.temperature, p.seed, p.logprobs),
            (5, 0.5, Some(3), 2)
        );
        assert_eq!(p.stop, vec!["x".to_string()]);
    }

    #[test]
    fn bad_lines_name_their_line_and_keep_a_custom_id() {
        let e = parse_line("{not json", 7, &job(), 1);
        assert!(
            e.custom_id.is_none() && e.request.unwrap_err().starts_with("line 7: not valid JSON")
        );
        let e = chat(r#"{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}"#);
        assert_eq!(e.custom_id.as_deref(), Some("a"));
        assert!(e.request.unwrap_err().contains("temperature"));
        let e = chat(r#"{"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}"#);
        assert!(e
            .request
            .unwrap_err()
            .contains("body.tools = [{}] is not supported"));
        let e = chat(r#"{"messages": [{"role": "user", "content": "hi"}], "n": 2}"#);
        assert!(e
            .request
            .unwrap_err()
            .contains("needs a temperature above 0"));
        for (n, ok) in [(0, false), (3, true), (4096, true), (4097, false)] {
            let body = format!(
                r#"{{"messages": [{{"role": "user", "content": "hi"}}], "n": {n}, "temperature": 1}}"#
            );
            let e = chat(&body);
            assert_eq!(
                e.request.as_ref().map(|r| r.1.n).ok(),
                ok.then_some(n),
                "{n}"
            );
        }
        let line = format!(
            r#"{{"custom_id": "b", "url": "{COMPLETIONS_URL}", "body": {{"prompt": "x"}}}}"#
        );
        let l = parse_line(&line, 2, &job(), 1);
        assert_eq!(l.endpoint, Some(Endpoint::Completions));
        assert_eq!(l.request.unwrap().0, Prompt::Text("x".into()));
        let line = r#"{"custom_id": "c", "url": "/v1/responses", "body": {"input": "x"}}"#;
        let e = parse_line(line, 5, &job(), 1);
        assert_eq!((e.endpoint, e.custom_id.as_deref()), (None, Some("c")));
        let e = e.request.unwrap_err();
        assert!(
            e.starts_with(
                "line 5: url must be \"/v1/chat/completions\", \"/v1/completions\" or \
                 \"/v1/embeddings\""
            ),
            "{e}"
        );
        let e = parse_line(
            r#"{"url": "/v1/completions", "body": {"prompt": "x"}}"#,
            4,
            &job(),
            1,
        );
        assert!(e.request.unwrap_err().contains("custom_id"));
    }

    const HI: &str = r#""messages": [{"role": "user", "content": "hi"}]"#;

    /// Lines as the OpenAI SDK and vLLM clients write them: every no-op value and metadata key
    /// is accepted, and changes nothing.
    #[test]
    fn no_op_values_and_metadata_keys_are_accepted() {
        let l = chat(&format!(
            r#"{{{HI}, "model": "gpt-4o", "response_format": {{"type": "text"}}, "logit_bias": {{}},
                "tools": null, "tool_choice": "none", "functions": null, "stream": false,
                "parallel_tool_calls": true, "logprobs": false, "user": "u1", "store": false,
                "metadata": {{"k": "v"}}, "service_tier": "auto", "n": 1, "echo": false,
                "top_logprobs": null, "stream_options": null, "seed": null,
                "spaces_between_special_tokens": true, "modalities": ["text"]}}"#
        ));
        assert_eq!(l.request.unwrap().1.as_ref(), job().as_ref());
        let line = format!(
            r#"{{"custom_id": "c", "url": "{COMPLETIONS_URL}", "body": {{"prompt": "x",
                "suffix": null, "echo": false, "best_of": 1, "logprobs": null, "user": "u"}}}}"#
        );
        let l = parse_line(&line, 1, &job(), 1);
        assert_eq!(l.request.unwrap().1.as_ref(), job().as_ref());
    }

    /// A value that asks for something eaglebatch does not do, or a key it does not know, is
    /// the line's error naming the key (and the value); never dropped.
    #[test]
    fn other_values_and_unknown_keys_are_error_lines_naming_them() {
        for (extra, want) in [
            (
                r#""response_format": {"type": "json"}"#,
                "body.response_format type \"json\"",
            ),
            (r#""logit_bias": {"7": 5}"#, "body.logit_bias = "),
            (r#""tool_choice": "required""#, "body.tool_choice = "),
            (r#""stream": true"#, "body.stream = true"),
            (r#""store": true"#, "body.store = true"),
            (r#""prompt_logprobs": 2"#, "body.prompt_logprobs = 2"),
            (
                r#""top_logprobs": 3"#,
                "body.top_logprobs = 3 needs body.logprobs",
            ),
            (
                r#""temprature": 0.5"#,
                "body.temprature is not a /v1/chat/completions key",
            ),
            (
                r#""suffix": "x""#,
                "body.suffix is not a /v1/chat/completions key",
            ),
        ] {
            let e = chat(&format!("{{{HI}, {extra}}}")).request.unwrap_err();
            assert!(e.starts_with(&format!("line 3: {want}")), "{extra}: {e}");
        }
    }

    #[test]
    fn message_keys_an_assistants_null_content_and_a_name() {
        let l = chat(
            r#"{"messages": [{"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": null, "tool_calls": [], "refusal": null},
                {"role": "user", "content": "more"}]}"#,
        );
        let Prompt::Chat(m) = l.request.unwrap().0 else {
            panic!()
        };
        assert_eq!(m[0][2], ("name".to_string(), Some("ann".to_string())));
        assert_eq!(m[1][1].1.as_deref(), Some(""));
        let e = chat(r#"{"messages": [{"role": "user", "content": null}]}"#);
        assert!(e.request.unwrap_err().contains("content must be"));
        let e =
            chat(r#"{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]}"#);
        assert!(e
            .request
            .unwrap_err()
            .contains("body.messages[0].tool_calls = "));
        let e = chat(r#"{"messages": [{"role": "user", "content": "x", "mood": "ok"}]}"#);
        assert!(e
            .request
            .unwrap_err()
            .contains("body.messages[0].mood is not"));
    }

    /// vLLM's per-line keys are the line's own: top_k -1 is off, seed -1 no seed of the
    /// line's (others, negative too, its seed), and min_p, ignore_eos, stop_token_ids,
    /// include_stop_str_in_output, skip_special_tokens, min_tokens, repetition_penalty apply.
    #[test]
    fn vllm_keys_apply_per_line() {
        let l = chat(&format!(
            r#"{{{HI}, "top_k": -1, "seed": -1, "min_p": 0.05, "ignore_eos": true,
                "stop_token_ids": [7, 9], "include_stop_str_in_output": true,
                "skip_special_tokens": false, "min_tokens": 2, "repetition_penalty": 1.1}}"#
        ));
        let p = l.request.unwrap().1;
        assert_eq!((p.top_k, p.seed, p.min_p), (0, None, 0.05));
        assert!(p.ignore_eos && p.include_stop_str_in_output && !p.skip_special_tokens);
        assert_eq!(p.stop_token_ids, vec![7, 9]);
        assert_eq!((p.min_new_tokens, p.repetition_penalty), (2, 1.1));
        let p = chat(&format!(r#"{{{HI}, "seed": -42, "top_k": 5}}"#))
            .request
            .unwrap()
            .1;
        assert_eq!((p.seed, p.top_k), (Some(-42), 5));
        for (extra, want) in [
            (r#""top_k": -2"#, "top_k must be in 0..="),
            (r#""min_p": 1.5"#, "min_p must be in [0, 1]"),
            (
                r#""ignore_eos": 1"#,
                "body.ignore_eos must be true or false",
            ),
            (
                r#""stop_token_ids": [-1]"#,
                "body.stop_token_ids must be a list of token ids",
            ),
            (
                r#""stop_token_ids": 7"#,
                "body.stop_token_ids must be a list",
            ),
            (r#""seed": 1e30"#, "body.seed must be a 64-bit integer"),
        ] {
            let e = chat(&format!("{{{HI}, {extra}}}")).request.unwrap_err();
            assert!(e.contains(want), "{extra}: {e}");
        }
        // a stop token id outside the model's vocabulary
        let mut j = job().as_ref().clone();
        j.vocab_size = 8;
        let line = format!(
            r#"{{"custom_id": "a", "url": "{CHAT_URL}", "body": {{{HI}, "stop_token_ids": [8]}}}}"#
        );
        let e = parse_line(&line, 1, &Arc::new(j), 1).request.unwrap_err();
        assert!(e.contains("stop_token_ids: 8 is not an id"), "{e}");
    }
    #[test]
    fn embedding_lines_carry_their_inputs_and_options() {
        let parse = |body: &str| {
            let line =
                format!(r#"{{"custom_id": "e", "url": "{EMBEDDINGS_URL}", "body": {body}}}"#);
            parse_line(&line, 3, &job(), 1)
        };
        let l = parse(r#"{"input": ["a", "b"], "dimensions": 8, "encoding_format": "base64"}"#);
        assert_eq!(l.endpoint, Some(Endpoint::Embeddings));
        let (prompt, params) = l.request.unwrap();
        let line = EmbedLine {
            dimensions: 8,
            base64: true,
        };
        assert_eq!(prompt, Prompt::Inputs(vec!["a".into(), "b".into()], line));
        assert_eq!(params.n, 2); // one sample per input
        let (prompt, _) = parse(r#"{"input": "x", "model": "m"}"#).request.unwrap();
        assert_eq!(
            prompt,
            Prompt::Inputs(vec!["x".into()], EmbedLine::default())
        );
        for (body, want) in [
            (r#"{"input": []}"#, "body.input has 0 inputs"),
            (r#"{"input": ["a", ""]}"#, "body.input[1] is empty"),
            (
                r#"{"input": [1, 2]}"#,
                "body.input must be a string or a list",
            ),
            (
                r#"{"input": "a", "dimensions": 0}"#,
                "body.dimensions must be at least 1",
            ),
            (
                r#"{"input": "a", "encoding_format": "hex"}"#,
                "body.encoding_format must be",
            ),
            (
                r#"{"input": "a", "n": 2}"#,
                "body.n is not a /v1/embeddings key",
            ),
        ] {
            let e = parse(body).request.unwrap_err();
            assert!(e.starts_with(&format!("line 3: {want}")), "{e}");
        }
    }
}
