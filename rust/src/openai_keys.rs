//! Which body keys an OpenAI Batch line may carry, and with which values.
//!
//! Every key OpenAI's chat and completions request bodies define, and vLLM's extensions to
//! them, is in `KEYS` with one rule: `Applied` (openai_batch.rs reads it: the prompt, the
//! sampling keys, n), `Metadata` (accepted whatever its value: it names, bills or routes the
//! request and never changes its output) or `NoOp` (accepted only with a value that asks
//! for nothing, such as `tools: []` or `response_format: {"type": "text"}`). A null is the
//! key's default everywhere, as in OpenAI's API, so it is always accepted.
//!
//! Invariant: nothing in a body is dropped silently. A key outside `KEYS` for the line's
//! endpoint, or a `NoOp` key with any other value, makes the line an error row naming the key
//! (and the value). docs/openai-batch.md holds the same table.

use serde_json::{Map, Value};

/// A line's endpoint (its `url`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// `task: embed` only (pooled.rs): body.input, one embedding per input.
    Embeddings,
}

pub const CHAT_URL: &str = "/v1/chat/completions";
pub const COMPLETIONS_URL: &str = "/v1/completions";
pub const EMBEDDINGS_URL: &str = "/v1/embeddings";

impl Endpoint {
    /// The endpoint a url names (None: not one eaglebatch serves).
    pub fn of(url: &str) -> Option<Endpoint> {
        match url {
            CHAT_URL => Some(Endpoint::Chat),
            COMPLETIONS_URL => Some(Endpoint::Completions),
            EMBEDDINGS_URL => Some(Endpoint::Embeddings),
            _ => None,
        }
    }

    pub fn url(self) -> &'static str {
        match self {
            Endpoint::Chat => CHAT_URL,
            Endpoint::Completions => COMPLETIONS_URL,
            Endpoint::Embeddings => EMBEDDINGS_URL,
        }
    }
}

/// Which endpoints a key belongs to.
#[derive(Debug, Clone, Copy)]
enum Scope {
    Chat,
    Completions,
    /// Chat and completions (the generation endpoints).
    Both,
    Embeddings,
}

impl Scope {
    fn covers(self, e: Endpoint) -> bool {
        matches!(
            (self, e),
            (Scope::Both, Endpoint::Chat)
                | (Scope::Chat, Endpoint::Chat)
                | (Scope::Both, Endpoint::Completions)
                | (Scope::Completions, Endpoint::Completions)
                | (Scope::Embeddings, Endpoint::Embeddings)
        )
    }
}

/// What a body asks for besides one key's value: the no-op tests of `tool_choice`,
/// `parallel_tool_calls` and `best_of` depend on other keys.
pub struct Body<'a> {
    pub body: &'a Map<String, Value>,
    /// The line's samples: its `n`, else the job's `sampling.n`.
    pub n: u64,
}

impl Body<'_> {
    /// No tools or functions are offered (a non-empty list is refused on its own key).
    fn no_tools(&self) -> bool {
        ["tools", "functions"]
            .iter()
            .all(|k| self.body.get(*k).is_none_or(is_empty_list))
    }
}

type NoOpTest = fn(&Value, &Body<'_>) -> bool;

#[derive(Clone, Copy)]
enum Rule {
    Applied,
    Metadata,
    /// The test a non-null value must pass, and the accepted values in words.
    NoOp(NoOpTest, &'static str),
}

fn is_empty_list(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(Vec::is_empty)
}

fn is_empty_object(v: &Value) -> bool {
    v.as_object().is_some_and(Map::is_empty)
}

const NULL_ONLY: Rule = Rule::NoOp(|_, _| false, "null");
const FALSE: Rule = Rule::NoOp(|v, _| v == &Value::Bool(false), "false");
const TRUE: Rule = Rule::NoOp(|v, _| v == &Value::Bool(true), "true");
const EMPTY_LIST: Rule = Rule::NoOp(|v, _| is_empty_list(v), "[]");
const EMPTY_OBJECT: Rule = Rule::NoOp(|v, _| is_empty_object(v), "{}");

/// `logit_bias`: no bias at all ({}, or every bias 0).
const NO_BIAS: Rule = Rule::NoOp(
    |v, _| {
        v.as_object()
            .is_some_and(|m| m.values().all(|b| b.as_f64() == Some(0.0)))
    },
    "{} or biases of 0",
);

/// `tool_choice` / `function_call`: no call ("none", or "auto" with nothing to call).
const NO_CALL: Rule = Rule::NoOp(
    |v, b| v == "none" || (v == "auto" && b.no_tools()),
    "\"none\" (or \"auto\" without tools)",
);

const KEYS: &[(&str, Scope, Rule)] = &[
    // The prompt and the sampling keys (openai_batch.rs).
    ("messages", Scope::Chat, Rule::Applied),
    ("prompt", Scope::Completions, Rule::Applied),
    ("max_tokens", Scope::Both, Rule::Applied),
    ("max_completion_tokens", Scope::Chat, Rule::Applied),
    ("temperature", Scope::Both, Rule::Applied),
    ("top_p", Scope::Both, Rule::Applied),
    ("stop", Scope::Both, Rule::Applied),
    ("seed", Scope::Both, Rule::Applied),
    ("frequency_penalty", Scope::Both, Rule::Applied),
    ("presence_penalty", Scope::Both, Rule::Applied),
    ("logprobs", Scope::Both, Rule::Applied),
    ("top_logprobs", Scope::Chat, Rule::Applied),
    ("n", Scope::Both, Rule::Applied),
    // vLLM's sampling extensions.
    ("top_k", Scope::Both, Rule::Applied),
    ("min_tokens", Scope::Both, Rule::Applied),
    ("repetition_penalty", Scope::Both, Rule::Applied),
    ("min_p", Scope::Both, Rule::Applied),
    ("ignore_eos", Scope::Both, Rule::Applied),
    ("stop_token_ids", Scope::Both, Rule::Applied),
    ("include_stop_str_in_output", Scope::Both, Rule::Applied),
    ("skip_special_tokens", Scope::Both, Rule::Applied),
    ("response_format", Scope::Both, Rule::Applied),
    // Names, billing and routing: the output is the same whatever they say.
    ("model", Scope::Both, Rule::Metadata),
    ("user", Scope::Both, Rule::Metadata),
    ("metadata", Scope::Chat, Rule::Metadata),
    ("service_tier", Scope::Chat, Rule::Metadata),
    ("safety_identifier", Scope::Chat, Rule::Metadata),
    ("prompt_cache_key", Scope::Chat, Rule::Metadata),
    ("prompt_cache_retention", Scope::Chat, Rule::Metadata),
    ("prompt_cache_options", Scope::Chat, Rule::Metadata),
    ("request_id", Scope::Both, Rule::Metadata),
    ("priority", Scope::Both, Rule::Metadata),
    ("cache_salt", Scope::Both, Rule::Metadata),
    // Accepted with the value that asks for nothing.
    ("stream", Scope::Both, FALSE),
    ("stream_options", Scope::Both, NULL_ONLY),
    ("store", Scope::Chat, FALSE),
    ("logit_bias", Scope::Both, NO_BIAS),
    ("tools", Scope::Chat, EMPTY_LIST),
    ("functions", Scope::Chat, EMPTY_LIST),
    ("tool_choice", Scope::Chat, NO_CALL),
    ("function_call", Scope::Chat, NO_CALL),
    (
        "parallel_tool_calls",
        Scope::Chat,
        Rule::NoOp(
            |v, b| v.is_boolean() && b.no_tools(),
            "true or false without tools",
        ),
    ),
    (
        "modalities",
        Scope::Chat,
        Rule::NoOp(|v, _| v == &serde_json::json!(["text"]), "[\"text\"]"),
    ),
    (
        "reasoning_effort",
        Scope::Chat,
        Rule::NoOp(|v, _| v == "none", "\"none\""),
    ),
    ("audio", Scope::Chat, NULL_ONLY),
    ("prediction", Scope::Chat, NULL_ONLY),
    ("verbosity", Scope::Chat, NULL_ONLY),
    ("web_search_options", Scope::Chat, NULL_ONLY),
    ("moderation", Scope::Chat, NULL_ONLY),
    ("echo", Scope::Both, FALSE),
    (
        "suffix",
        Scope::Completions,
        Rule::NoOp(|v, _| v == "", "\"\""),
    ),
    (
        "best_of",
        Scope::Completions,
        Rule::NoOp(|v, b| v.as_u64() == Some(b.n), "the line's n"),
    ),
    // vLLM's extensions, with their defaults (or what eaglebatch does: a chat prompt is
    // rendered with the generation prompt and tokenized without special tokens, a completion
    // prompt with them).
    ("prompt_logprobs", Scope::Both, NULL_ONLY),
    ("spaces_between_special_tokens", Scope::Both, TRUE),
    ("use_beam_search", Scope::Both, FALSE),
    (
        "length_penalty",
        Scope::Both,
        Rule::NoOp(
            |v, _| v.is_number(),
            "any number (only beam search reads it)",
        ),
    ),
    ("truncate_prompt_tokens", Scope::Both, NULL_ONLY),
    ("allowed_token_ids", Scope::Both, NULL_ONLY),
    ("bad_words", Scope::Both, EMPTY_LIST),
    ("logits_processors", Scope::Both, NULL_ONLY),
    ("return_tokens_as_token_ids", Scope::Both, FALSE),
    ("return_token_ids", Scope::Both, FALSE),
    ("structured_outputs", Scope::Both, NULL_ONLY),
    ("guided_json", Scope::Both, NULL_ONLY),
    ("guided_regex", Scope::Both, NULL_ONLY),
    ("guided_choice", Scope::Both, NULL_ONLY),
    ("guided_grammar", Scope::Both, NULL_ONLY),
    ("guided_decoding_backend", Scope::Both, NULL_ONLY),
    ("guided_whitespace_pattern", Scope::Both, NULL_ONLY),
    ("kv_transfer_params", Scope::Both, NULL_ONLY),
    ("vllm_xargs", Scope::Both, NULL_ONLY),
    ("add_generation_prompt", Scope::Chat, TRUE),
    ("continue_final_message", Scope::Chat, FALSE),
    ("add_special_tokens", Scope::Chat, FALSE),
    ("add_special_tokens", Scope::Completions, TRUE),
    ("documents", Scope::Chat, NULL_ONLY),
    ("chat_template", Scope::Chat, NULL_ONLY),
    ("chat_template_kwargs", Scope::Chat, EMPTY_OBJECT),
    ("mm_processor_kwargs", Scope::Chat, EMPTY_OBJECT),
    // Embeddings (task embed): the inputs, the Matryoshka cut and the results' encoding.
    ("input", Scope::Embeddings, Rule::Applied),
    ("dimensions", Scope::Embeddings, Rule::Applied),
    ("encoding_format", Scope::Embeddings, Rule::Applied),
    ("model", Scope::Embeddings, Rule::Metadata),
    ("user", Scope::Embeddings, Rule::Metadata),
];

fn rule(key: &str, e: Endpoint) -> Option<Rule> {
    KEYS.iter()
        .find(|(k, scope, _)| *k == key && scope.covers(e))
        .map(|(_, _, r)| *r)
}

/// `v` for a message, cut to a readable length.
pub fn shown(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s,
    }
}

/// The first body key the line may not carry (unknown for its endpoint, or a no-op key with
/// a value that asks for something), as the line's error.
pub fn check_body(b: &Body<'_>, e: Endpoint, url: &str) -> Result<(), String> {
    for (key, v) in b.body {
        match rule(key, e) {
            None => {
                return Err(format!(
                    "body.{key} is not a {url} key eaglebatch knows (it refuses what it would \
                     not apply; docs/openai-batch.md lists the keys)"
                ))
            }
            Some(Rule::NoOp(ok, what)) if !v.is_null() && !ok(v, b) => {
                return Err(format!(
                    "body.{key} = {} is not supported (accepted: {what})",
                    shown(v)
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Keys of a chat message besides `role` and `content` (read by openai_batch.rs): `name`
/// goes to the chat template like them; the others are accepted only empty (null, or `[]`
/// for `tool_calls`), since eaglebatch makes no tool calls and keeps no audio.
pub fn check_message_key(j: usize, key: &str, v: &Value) -> Result<(), String> {
    let empty = match key {
        "role" | "content" | "name" => true,
        "tool_calls" => is_empty_list(v),
        "function_call" | "refusal" | "audio" | "tool_call_id" | "reasoning_content"
        | "reasoning" => v.is_null(),
        _ => {
            return Err(format!(
                "body.messages[{j}].{key} is not a message key eaglebatch knows"
            ))
        }
    };
    if empty {
        Ok(())
    } else {
        Err(format!(
            "body.messages[{j}].{key} = {} is not supported (eaglebatch makes no tool calls)",
            shown(v)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(body: Value, e: Endpoint) -> Result<(), String> {
        let body = body.as_object().unwrap().clone();
        check_body(&Body { body: &body, n: 1 }, e, "/v1/x")
    }

    #[test]
    fn every_key_has_one_rule_per_endpoint() {
        for e in [Endpoint::Chat, Endpoint::Completions, Endpoint::Embeddings] {
            for (i, (k, scope, _)) in KEYS.iter().enumerate() {
                let again = KEYS[i + 1..]
                    .iter()
                    .any(|(k2, s2, _)| k2 == k && s2.covers(e) && scope.covers(e));
                assert!(!again, "{k} has two rules for {e:?}");
            }
        }
    }

    #[test]
    fn no_op_values_and_metadata_pass_other_values_name_the_key() {
        let chat = json!({"response_format": {"type": "text"}, "logit_bias": {}, "tools": null,
            "functions": [], "tool_choice": "none", "parallel_tool_calls": true, "store": false,
            "stream": false, "user": "u", "metadata": {"a": "b"}, "service_tier": "flex",
            "modalities": ["text"], "reasoning_effort": null, "stream_options": null,
            "spaces_between_special_tokens": true, "model": "gpt-x"});
        assert_eq!(check(chat, Endpoint::Chat), Ok(()));
        let completions = json!({"echo": false, "suffix": "", "best_of": 1, "logit_bias":
            {"50256": 0}, "add_special_tokens": true});
        assert_eq!(check(completions, Endpoint::Completions), Ok(()));
        for (body, key) in [
            (json!({"tools": [{"type": "function"}]}), "tools"),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (json!({"stream": true}), "stream"),
            (json!({"logit_bias": {"5": 2}}), "logit_bias"),
            (json!({"store": true}), "store"),
            (
                json!({"stream_options": {"include_usage": true}}),
                "stream_options",
            ),
        ] {
            let e = check(body, Endpoint::Chat).unwrap_err();
            assert!(e.starts_with(&format!("body.{key} = ")), "{e}");
            assert!(e.contains("accepted:"), "{e}");
        }
        let e = check(json!({"suffix": "x"}), Endpoint::Completions).unwrap_err();
        assert!(e.contains("body.suffix = \"x\""), "{e}");
        let e = check(json!({"best_of": 2}), Endpoint::Completions).unwrap_err();
        assert!(e.contains("body.best_of = 2"), "{e}");
    }

    #[test]
    fn unknown_keys_and_other_endpoints_keys_are_refused() {
        let e = check(json!({"temprature": 0.5}), Endpoint::Chat).unwrap_err();
        assert!(e.starts_with("body.temprature is not a /v1/x key"), "{e}");
        let e = check(json!({"messages": []}), Endpoint::Completions).unwrap_err();
        assert!(e.starts_with("body.messages is not"), "{e}");
        let e = check(json!({"suffix": null}), Endpoint::Chat).unwrap_err();
        assert!(e.starts_with("body.suffix is not"), "{e}");
        // "auto" calls nothing only while no tool is offered.
        assert!(check(json!({"tool_choice": "auto"}), Endpoint::Chat).is_ok());
        let e = check(
            json!({"tool_choice": "auto", "parallel_tool_calls": false, "tools": [{}]}),
            Endpoint::Chat,
        );
        assert!(e.is_err());
    }

    #[test]
    fn message_keys() {
        assert!(check_message_key(0, "name", &json!("bob")).is_ok());
        assert!(check_message_key(0, "tool_calls", &json!([])).is_ok());
        assert!(check_message_key(0, "refusal", &Value::Null).is_ok());
        let e = check_message_key(1, "tool_calls", &json!([{"id": "x"}])).unwrap_err();
        assert!(e.starts_with("body.messages[1].tool_calls = "), "{e}");
        let e = check_message_key(2, "colour", &json!("red")).unwrap_err();
        assert!(e.starts_with("body.messages[2].colour is not"), "{e}");
        assert!(shown(&json!("x".repeat(100))).ends_with("..."));
    }
}
