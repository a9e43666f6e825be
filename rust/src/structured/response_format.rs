//! `response_format`: what a row's output must match, from its JSON text.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Map, Value};

/// One row's constraint. OpenAI's spellings: `{"type": "json_schema", "json_schema": {"name",
/// "schema", "strict", "description"}}` and `{"type": "json_object"}`; ours: `{"type": "regex",
/// "pattern"}`, `{"type": "grammar", "lark"}`, `{"type": "choice", "choices": [..]}`.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    JsonSchema(Value),
    JsonObject,
    Regex(String),
    Lark(String),
    Choice(Vec<String>),
}

/// JSON whitespace between tokens unless the schema asks otherwise: spaces or tabs, or one
/// line break and an indentation, per gap (pretty-printed JSON fits; runs of blank lines do
/// not, which a small model may otherwise emit until its token budget is spent). A schema
/// whose root `x-guidance` sets `whitespace_flexible` or `whitespace_pattern` (llguidance's
/// JSON options) gets what it sets.
pub const JSON_WHITESPACE: &str = r"[ \t]{1,4}|\n[ \t]{0,32}";

const TYPES: &str = "text, json_schema, json_object, regex, grammar or choice";

impl ResponseFormat {
    /// Parses the JSON text of a response_format; the error names what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| format!("response_format is not JSON: {e}"))?;
        Self::from_value(&value)
    }

    /// A request's format from its JSON text: None for `{"type": "text"}` (free text, OpenAI's
    /// default), else as `parse`.
    pub fn parse_request(text: &str) -> Result<Option<Self>, String> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| format!("response_format is not JSON: {e}"))?;
        Self::of_request(&value)
    }

    /// As `parse_request`, from a parsed value (an OpenAI Batch line's body).
    pub fn of_request(value: &Value) -> Result<Option<Self>, String> {
        let is_text = value.get("type").and_then(Value::as_str) == Some("text");
        if is_text && value.as_object().is_some_and(|o| o.len() == 1) {
            return Ok(None);
        }
        Self::from_value(value).map(Some)
    }

    pub fn from_value(value: &Value) -> Result<Self, String> {
        let obj = value
            .as_object()
            .ok_or("response_format must be a JSON object")?;
        let kind = obj
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("response_format needs a \"type\": {TYPES}"))?;
        let (payload, format) = match kind {
            "json_schema" => ("json_schema", json_schema(obj)?),
            "json_object" => ("", ResponseFormat::JsonObject),
            "regex" => ("pattern", ResponseFormat::Regex(text_key(obj, "pattern")?)),
            "grammar" => ("lark", ResponseFormat::Lark(text_key(obj, "lark")?)),
            "choice" => ("choices", ResponseFormat::Choice(choices(obj)?)),
            other => return Err(format!("response_format type {other:?}: expected {TYPES}")),
        };
        if let Some(k) = obj.keys().find(|k| *k != "type" && *k != payload) {
            return Err(format!("response_format of type {kind}: unknown key {k:?}"));
        }
        Ok(format)
    }

    /// The grammar llguidance compiles.
    pub fn grammar(&self) -> TopLevelGrammar {
        match self {
            ResponseFormat::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(bounded_whitespace(schema))
            }
            ResponseFormat::JsonObject => {
                TopLevelGrammar::from_json_schema(bounded_whitespace(&json!({"type": "object"})))
            }
            ResponseFormat::Regex(pattern) => TopLevelGrammar::from_regex(pattern),
            ResponseFormat::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            ResponseFormat::Choice(choices) => {
                let alts: Vec<String> = choices
                    .iter()
                    .map(|c| Value::from(c.as_str()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
        }
    }

    /// The format's text, the key of the compiled-grammar cache: equal for equal formats (object
    /// keys in their order: a schema's property order is the order it generates them in).
    pub fn key(&self) -> String {
        match self {
            ResponseFormat::JsonSchema(s) => format!("json_schema:{s}"),
            ResponseFormat::JsonObject => "json_object".to_string(),
            ResponseFormat::Regex(p) => format!("regex:{p}"),
            ResponseFormat::Lark(l) => format!("lark:{l}"),
            ResponseFormat::Choice(c) => format!("choice:{}", Value::from(c.clone())),
        }
    }
}

/// `schema` with `JSON_WHITESPACE` as its whitespace, unless its root's `x-guidance` names
/// `whitespace_flexible` or `whitespace_pattern` (its other options are kept either way).
fn bounded_whitespace(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(root) = schema.as_object_mut() {
        let options = root.entry("x-guidance").or_insert_with(|| json!({}));
        if let Some(o) = options.as_object_mut() {
            if !o.contains_key("whitespace_flexible") && !o.contains_key("whitespace_pattern") {
                o.insert("whitespace_pattern".into(), JSON_WHITESPACE.into());
            }
        }
    }
    schema
}

fn json_schema(obj: &Map<String, Value>) -> Result<ResponseFormat, String> {
    let spec = obj
        .get("json_schema")
        .and_then(Value::as_object)
        .ok_or("response_format json_schema needs a \"json_schema\" object")?;
    if let Some(k) = spec
        .keys()
        .find(|k| !["name", "schema", "strict", "description"].contains(&k.as_str()))
    {
        return Err(format!("response_format json_schema: unknown key {k:?}"));
    }
    match spec.get("schema") {
        Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
            Ok(ResponseFormat::JsonSchema(schema.clone()))
        }
        Some(_) => Err("response_format json_schema.schema must be a JSON object".to_string()),
        None => Err("response_format json_schema needs a \"schema\"".to_string()),
    }
}

fn text_key(obj: &Map<String, Value>, key: &str) -> Result<String, String> {
    match obj.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        _ => Err(format!(
            "response_format needs a non-empty string \"{key}\""
        )),
    }
}

fn choices(obj: &Map<String, Value>) -> Result<Vec<String>, String> {
    let list = obj.get("choices").and_then(Value::as_array);
    let texts: Option<Vec<String>> = list.map(|l| {
        l.iter()
            .filter_map(|v| v.as_str().filter(|s| !s.is_empty()).map(str::to_string))
            .collect()
    });
    match (list, texts) {
        (Some(l), Some(t)) if !t.is_empty() && t.len() == l.len() => Ok(t),
        _ => Err(
            "response_format choice needs \"choices\": a non-empty list of non-empty strings"
                .to_string(),
        ),
    }
}
