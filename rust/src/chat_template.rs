//! Hugging Face chat templates rendered with minijinja, configured like transformers'
//! `apply_chat_template` (Jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True)` with loop controls, `raise_exception`, `strftime_now` and transformers'
//! own `tojson`, i.e. `json.dumps(x, ensure_ascii=False)` with Python's separators).
//!
//! Context: `messages`, `add_generation_prompt`, and `bos_token` / `eos_token` when known
//! (transformers passes only the special tokens the tokenizer has, so unknown ones stay
//! undefined and render as "").
//!
//! A render is bounded in instructions (minijinja's fuel, `fuel_budget`) and in memory
//! (`memory_limit`, template_memory.rs): the compiled code is rewritten (`guarded`) so that
//! after every instruction that can allocate a check runs, and `~` measures its text first.
//! The rewrite uses minijinja's `unstable_machinery` API, so minijinja is pinned exactly.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use minijinja::machinery::{
    make_string_output, CompiledTemplate, TemplateConfig, Vm, WhitespaceConfig,
};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind};

use crate::error::{Error, Result};
use crate::template_guard::{guarded, has_lazy_constant};
use crate::template_memory::{self, Metered};

/// One chat message: its fields in order (`role`, `content`, ...). `None` is Python's `None`.
pub type Message = Vec<(String, Option<String>)>;

/// A compiled chat template: the environment (functions, filters, checks) and the guarded code.
pub struct ChatTemplate {
    env: Environment<'static>,
    code: CompiledTemplate<'static>,
    /// The `enable_thinking` variable of every render (reasoning models), when set.
    enable_thinking: Option<bool>,
}

const TEMPLATE_NAME: &str = "chat_template";

/// Fuel (minijinja instructions, see `fuel_budget`) a render may use: a base, plus some per
/// message and per byte of message text (keys and values). The ChatML (SmolLM2, Qwen 2),
/// Llama 3, Zephyr and Mistral templates execute 23 to 33 instructions per message, so a
/// conversation of any length has hundreds of times the fuel it needs, and a template looping
/// over every character of the text still has 4 per character; only a runaway loop runs out.
const FUEL_BASE: u64 = 1_000_000;
const FUEL_PER_MESSAGE: u64 = 10_000;
const FUEL_PER_BYTE: u64 = 4;

/// The guards `guarded` adds cost fuel too (at most 2 per instruction of the template): the
/// environment's fuel is this many times the budget, which counts the template's own.
const GUARD_FUEL_FACTOR: u64 = 3;

/// Memory (bytes held at once, template_memory.rs) a render may use: a base, plus some per
/// byte of message text, plus twice its output limit (the output's own buffer grows by
/// doubling). Rendering a conversation needs about its size a few times over.
pub const MEMORY_BASE: usize = 16 << 20;
pub const MEMORY_PER_BYTE: usize = 8;

/// The output limit of `render_chat_template` (the Python helper), which has no text limit.
pub const HELPER_MAX_OUTPUT: usize = 64 << 20;

/// Why a render produced no text.
#[derive(Debug)]
pub enum RenderError {
    /// The template failed (`raise_exception`, a type error, ...).
    Template(Error),
    /// The output grew past the byte limit the caller gave.
    OutputTooLong,
    /// The template executed more instructions than this budget.
    OutOfFuel(u64),
    /// The render held more memory than this many bytes (`memory_limit`).
    OutOfMemory(usize),
}

impl From<RenderError> for Error {
    fn from(e: RenderError) -> Self {
        match e {
            RenderError::Template(e) => e,
            RenderError::OutputTooLong => Error::Template("chat template output too long".into()),
            RenderError::OutOfFuel(n) => Error::Template(format!(
                "chat template ran too long (more than {n} template instructions)"
            )),
            RenderError::OutOfMemory(n) => Error::Template(memory_message(n)),
        }
    }
}

/// Bytes of message text (keys and values) of a conversation.
fn conversation_bytes(messages: &[Message]) -> usize {
    messages
        .iter()
        .flatten()
        .map(|(k, v)| k.len() + v.as_ref().map_or(0, String::len))
        .sum()
}

/// Instructions a render of `messages` may execute: linear in the conversation's size, so
/// a long conversation never runs out while a template loop that does not end stops.
fn fuel_budget(messages: &[Message]) -> u64 {
    FUEL_BASE
        .saturating_add(FUEL_PER_MESSAGE.saturating_mul(messages.len() as u64))
        .saturating_add(FUEL_PER_BYTE.saturating_mul(conversation_bytes(messages) as u64))
}

/// Bytes a render of `messages` with output limit `max_output_bytes` may hold at once.
pub fn memory_limit(messages: &[Message], max_output_bytes: usize) -> usize {
    MEMORY_BASE
        .saturating_add(MEMORY_PER_BYTE.saturating_mul(conversation_bytes(messages)))
        .saturating_add(max_output_bytes.saturating_mul(2))
}

/// The error of a render over its memory limit of `limit` bytes.
pub fn memory_message(limit: usize) -> String {
    format!(
        "chat template used more than its memory limit of {:.1} MiB (16 MiB + 8 bytes per \
         byte of the conversation + twice the output limit): a template building huge \
         strings or lists?",
        limit as f64 / (1 << 20) as f64
    )
}

/// Sources of compiled templates, kept for the process's life (compiled code borrows its
/// source for `'static`): each distinct source is kept once however often it is compiled.
fn intern(source: String) -> &'static str {
    static SOURCES: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut sources = SOURCES.lock().unwrap_or_else(|e| e.into_inner());
    let sources = sources.get_or_insert_with(HashSet::new);
    if let Some(s) = sources.get(source.as_str()) {
        return s;
    }
    let s: &'static str = Box::leak(source.into_boxed_str());
    sources.insert(s);
    s
}

/// The environment a template renders in: transformers' settings, functions and filters,
/// and the memory checks (template_memory.rs).
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    template_memory::install(&mut env);
    env
}

/// The compile settings: Jinja2's whitespace (trim_blocks, lstrip_blocks, a single trailing
/// newline of the source dropped) and no autoescape.
fn template_config() -> TemplateConfig {
    TemplateConfig {
        syntax_config: Default::default(),
        ws_config: WhitespaceConfig {
            keep_trailing_newline: false,
            lstrip_blocks: true,
            trim_blocks: true,
        },
        default_auto_escape: Arc::new(|_: &str| AutoEscape::None),
    }
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is a `Template` error.
    pub fn new(source: &str) -> Result<Self> {
        let source = intern(rewrite_generation_tags(source));
        let mut code = CompiledTemplate::new(TEMPLATE_NAME, source, &template_config())
            .map_err(|e| Error::Template(format_minijinja_error(&e)))?;
        if has_lazy_constant(&code.instructions) || code.blocks.values().any(has_lazy_constant) {
            return Err(Error::Template(
                "the template joins or repeats constant lists (`[..] + [..]`, `[..] * n`), \
                 whose size eaglebatch cannot bound; write the list out"
                    .into(),
            ));
        }
        code.instructions = guarded(&code.instructions);
        for block in code.blocks.values_mut() {
            *block = guarded(block);
        }
        Ok(ChatTemplate {
            env: environment(),
            code,
            enable_thinking: None,
        })
    }

    /// Renders with `enable_thinking` set to `on` (Qwen 3's switch) when given.
    pub fn with_enable_thinking(mut self, on: Option<bool>) -> Self {
        self.enable_thinking = on;
        self
    }

    /// Renders `messages`; the output never exceeds `max_output_bytes`, the work is bounded
    /// by `fuel_budget` and the memory held at once by `memory_limit`.
    pub fn render(
        &mut self,
        messages: &[Message],
        add_generation_prompt: bool,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
        max_output_bytes: usize,
    ) -> std::result::Result<String, RenderError> {
        let fuel = fuel_budget(messages);
        let mut ctx = context(messages, add_generation_prompt, bos_token, eos_token);
        if let Some(on) = self.enable_thinking {
            ctx = minijinja::context! { enable_thinking => on, ..ctx };
        }
        self.env
            .set_fuel(Some(fuel.saturating_mul(GUARD_FUEL_FACTOR)));
        let limit = memory_limit(messages, max_output_bytes);
        let mut buf = String::new();
        let meter = Metered::start(limit);
        let result = {
            let mut out = make_string_output(&mut buf);
            let code = &self.code;
            Vm::new(&self.env)
                .eval(
                    &code.instructions,
                    ctx,
                    &code.blocks,
                    &mut out,
                    code.initial_auto_escape,
                )
                .map(drop)
        };
        let tripped = meter.tripped();
        drop(meter);
        match result {
            _ if buf.len() > max_output_bytes => Err(RenderError::OutputTooLong),
            Ok(()) => Ok(buf),
            Err(_) if tripped => Err(RenderError::OutOfMemory(limit)),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(RenderError::OutOfFuel(fuel)),
            Err(e) => Err(RenderError::Template(Error::Template(
                format_minijinja_error(&e),
            ))),
        }
    }
}

/// The render context: `messages`, `add_generation_prompt` and the known special tokens.
fn context(
    messages: &[Message],
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let v = match v {
                        Some(s) => Value::from(s.as_str()),
                        None => Value::from(()),
                    };
                    (Value::from(k.as_str()), v)
                })
                .collect::<Value>()
        })
        .collect();
    let mut ctx: Vec<(&str, Value)> = vec![
        ("messages", Value::from(messages)),
        ("add_generation_prompt", Value::from(add_generation_prompt)),
    ];
    if let Some(bos) = bos_token {
        ctx.push(("bos_token", Value::from(bos)));
    }
    if let Some(eos) = eos_token {
        ctx.push(("eos_token", Value::from(eos)));
    }
    ctx.into_iter().collect()
}

/// One-shot render (compiles the template each call) with output limit `HELPER_MAX_OUTPUT`;
/// used by the Python parity helper.
pub fn render_chat_template(
    template: &str,
    messages: &[Message],
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Result<String> {
    ChatTemplate::new(template)?
        .render(
            messages,
            add_generation_prompt,
            bos_token,
            eos_token,
            HELPER_MAX_OUTPUT,
        )
        .map_err(Error::from)
}

fn format_minijinja_error(e: &minijinja::Error) -> String {
    // `raise_exception` messages are shown verbatim (like transformers' TemplateError).
    if e.kind() == ErrorKind::InvalidOperation {
        if let Some(detail) = e.detail() {
            if let Some(msg) = detail.strip_prefix(RAISED_PREFIX) {
                return msg.to_string();
            }
        }
    }
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let _ = write!(msg, ": {s}");
        source = s.source();
    }
    msg
}

const RAISED_PREFIX: &str = "raise_exception: ";

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED_PREFIX}{msg}"),
    ))
}

/// transformers' `{% generation %}` / `{% endgeneration %}` tags only mark assistant tokens for
/// training masks; for rendering they are a no-op block, so they become `{% if true %}` /
/// `{% endif %}` (same whitespace-control markers, so trimming behaves identically).
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let left = if inner.starts_with(['-', '+']) {
            &inner[..1]
        } else {
            ""
        };
        let right = if inner.len() > left.len() && inner.ends_with(['-', '+']) {
            &inner[inner.len() - 1..]
        } else {
            ""
        };
        let body = inner[left.len()..inner.len() - right.len()].trim();
        match body {
            "generation" => out.push_str(&format!("{{%{left} if true {right}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{left} endif {right}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, with Python's default separators (", " and ": "; "," with an indent).
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    // The JSON is the value's text within a small factor (escapes): measured first.
    template_memory::fits_as_text(std::slice::from_ref(value), 0, "a tojson result")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v).map_err(|_| {
                minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: bad indent")
            })?)),
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// Appends `v` as JSON exactly as Python's `json.dumps` with options `o` writes it; `depth`
/// is the nesting level (for indentation). Values JSON lacks are written as strings.
fn write_json(
    out: &mut String,
    v: &Value,
    o: &JsonOpts,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_json_number(out, v),
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Map => write_json_map(out, v, o, depth)?,
        ValueKind::Seq | ValueKind::Iterable => write_json_seq(out, v, o, depth)?,
        _ => write_json_str(out, &v.to_string(), o.ensure_ascii),
    }
    Ok(())
}

/// An integer as is, a float as Python's `repr(float)`.
fn write_json_number(out: &mut String, v: &Value) {
    if v.is_integer() {
        out.push_str(&v.to_string());
    } else {
        out.push_str(&python_float_repr(
            f64::try_from(v.clone()).unwrap_or(f64::NAN),
        ));
    }
}

/// A map as a JSON object, keys in map order (sorted with `sort_keys`); a key that is not a
/// string is written as its string form. An empty map is `{}` whatever the indent.
fn write_json_map(
    out: &mut String,
    v: &Value,
    o: &JsonOpts,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    let mut keys: Vec<Value> = v.try_iter()?.collect();
    if keys.is_empty() {
        out.push_str("{}");
        return Ok(());
    }
    if o.sort_keys {
        keys.sort();
    }
    out.push('{');
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        newline_indent(out, o, depth + 1);
        match k.as_str() {
            Some(s) => write_json_str(out, s, o.ensure_ascii),
            None => write_json_str(out, &k.to_string(), o.ensure_ascii),
        }
        out.push_str(&o.key_sep);
        write_json(out, &v.get_item(k)?, o, depth + 1)?;
    }
    newline_indent(out, o, depth);
    out.push('}');
    Ok(())
}

/// A sequence (or other iterable) as a JSON array. An empty one is `[]` whatever the indent.
fn write_json_seq(
    out: &mut String,
    v: &Value,
    o: &JsonOpts,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    let items: Vec<Value> = v.try_iter()?.collect();
    if items.is_empty() {
        out.push_str("[]");
        return Ok(());
    }
    out.push('[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        newline_indent(out, o, depth + 1);
        write_json(out, item, o, depth + 1)?;
    }
    newline_indent(out, o, depth);
    out.push(']');
    Ok(())
}

fn newline_indent(out: &mut String, o: &JsonOpts, depth: usize) {
    if let Some(ind) = &o.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

/// A JSON string literal exactly as Python's `json.dumps` writes it.
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` (as used by `json.dumps`).
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Shortest round-trip digits in exponent form: 1e+20, 1.5e-05.
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').expect("exponent form");
        let exp: i32 = exp.parse().expect("exponent");
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mant}e{sign}{:02}", exp.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

/// `strftime_now(fmt)` (Llama 3.x templates): the current UTC time formatted with the common
/// strftime directives (%d %m %Y %y %b %B %a %A %H %M %S %j %%).
fn strftime_now(fmt: String) -> std::result::Result<Value, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&fmt, secs).map(Value::from)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A UTC instant broken down into calendar fields (proleptic Gregorian).
struct CivilTime {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    /// 0..=6, Monday = 0.
    weekday: usize,
    /// Day of the year, 1..=366.
    yday: i64,
    secs_of_day: i64,
}

impl CivilTime {
    fn from_unix(unix_secs: i64) -> Self {
        let days = unix_secs.div_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        CivilTime {
            year,
            month,
            day,
            // 1970-01-01 was a Thursday (index 3 with Monday = 0).
            weekday: (days + 3).rem_euclid(7) as usize,
            yday: days - days_from_civil(year, 1, 1) + 1,
            secs_of_day: unix_secs.rem_euclid(86_400),
        }
    }
}

/// `fmt` with its strftime directives replaced by the fields of `unix_secs` (UTC); an
/// unsupported directive (or a lone trailing '%') is an error.
fn strftime(fmt: &str, unix_secs: i64) -> std::result::Result<String, minijinja::Error> {
    let t = CivilTime::from_unix(unix_secs);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let directive = chars.next();
        if !write_directive(&mut out, directive, &t) {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "strftime_now: unsupported directive %{}",
                    directive.unwrap_or(' ')
                ),
            ));
        }
    }
    Ok(out)
}

/// Appends the value of directive `%{d}` for `t`; false (nothing written) if unsupported.
fn write_directive(out: &mut String, d: Option<char>, t: &CivilTime) -> bool {
    let month = MONTHS[t.month as usize - 1];
    let weekday = DAYS[t.weekday];
    let secs = t.secs_of_day;
    match d {
        Some('d') => write!(out, "{:02}", t.day),
        Some('m') => write!(out, "{:02}", t.month),
        Some('Y') => write!(out, "{}", t.year),
        Some('y') => write!(out, "{:02}", t.year.rem_euclid(100)),
        Some('b') => write!(out, "{}", &month[..3]),
        Some('B') => write!(out, "{month}"),
        Some('a') => write!(out, "{}", &weekday[..3]),
        Some('A') => write!(out, "{weekday}"),
        Some('H') => write!(out, "{:02}", secs / 3600),
        Some('M') => write!(out, "{:02}", secs / 60 % 60),
        Some('S') => write!(out, "{:02}", secs % 60),
        Some('j') => write!(out, "{:03}", t.yday),
        Some('%') => write!(out, "%"),
        _ => return false,
    }
    .expect("writing to a String cannot fail");
    true
}

/// Days since 1970-01-01 -> (year, month 1..=12, day 1..=31), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        vec![
            ("role".to_string(), Some(role.to_string())),
            ("content".to_string(), Some(content.to_string())),
        ]
    }

    /// `enable_thinking` reaches the template when set (Qwen 3's switch), and is undefined
    /// otherwise, so a template's own default applies.
    #[test]
    fn enable_thinking_is_a_template_variable_when_set() {
        let src = "{% if enable_thinking is defined and not enable_thinking %}<think></think>\
                   {% endif %}{{ messages[0]['content'] }}";
        let msgs = [msg("user", "hi")];
        let render = |on: Option<bool>| {
            let mut t = ChatTemplate::new(src).unwrap().with_enable_thinking(on);
            t.render(&msgs, true, None, None, 1 << 20).unwrap()
        };
        assert_eq!(render(Some(false)), "<think></think>hi");
        assert_eq!(render(Some(true)), "hi");
        assert_eq!(render(None), "hi");
    }

    /// SmolLM2's template (ChatML with a default system prompt).
    pub const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// Llama-3 (8B-Instruct) template.
    pub const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    #[test]
    fn smollm2_matches_transformers() {
        let out =
            render_chat_template(SMOLLM2, &[msg("user", "Hi there")], true, None, None).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn llama3_uses_bos_and_trims() {
        let out = render_chat_template(
            LLAMA3,
            &[msg("system", "  Be brief. "), msg("user", "Hello")],
            true,
            Some("<|begin_of_text|>"),
            Some("<|eot_id|>"),
        )
        .unwrap();
        assert_eq!(
            out,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        // With trim_blocks the newline after a block tag goes; with lstrip_blocks the indentation
        // before a block tag goes.
        let tmpl = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}\n";
        let out = render_chat_template(
            tmpl,
            &[msg("user", "a"), msg("user", "b")],
            false,
            None,
            None,
        )
        .unwrap();
        assert_eq!(out, "U:a\nU:b\n");
    }

    #[test]
    fn raise_exception_message_is_kept() {
        let tmpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok";
        let err =
            render_chat_template(tmpl, &[msg("assistant", "x")], false, None, None).unwrap_err();
        assert!(
            matches!(err, Error::Template(ref m) if m == "Conversation must start with user"),
            "{err}"
        );
    }

    #[test]
    fn python_string_methods_and_loop_controls() {
        let tmpl = "{% for m in messages %}{% if m.content.startswith('skip') %}{% continue %}{% endif %}[{{ m.content.strip().upper() }}]{% endfor %}";
        let out = render_chat_template(
            tmpl,
            &[msg("user", " a "), msg("user", "skip me"), msg("user", "b")],
            false,
            None,
            None,
        )
        .unwrap();
        assert_eq!(out, "[A][B]");
    }

    #[test]
    fn tojson_like_python_json_dumps() {
        let tmpl = "{{ messages[0] | tojson }}|{{ [1, 2.5, none, true, 'é\"\\n'] | tojson }}|{{ messages[0] | tojson(indent=2) }}";
        let out = render_chat_template(tmpl, &[msg("user", "<b>&")], false, None, None).unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": \"<b>&\"}|[1, 2.5, null, true, \"é\\\"\\n\"]|{\n  \"role\": \"user\",\n  \"content\": \"<b>&\"\n}"
        );
    }

    #[test]
    fn undefined_tokens_render_empty() {
        let out = render_chat_template("{{ bos_token }}x{{ eos_token }}", &[], false, None, None)
            .unwrap();
        assert_eq!(out, "x");
    }

    #[test]
    fn generation_tags_are_transparent() {
        let tmpl = "{% for m in messages %}{%- generation -%}\n{{ m.content }}{% endgeneration %}{% endfor %}";
        let out = render_chat_template(tmpl, &[msg("assistant", "x")], false, None, None).unwrap();
        assert_eq!(out, "x");
    }

    #[test]
    fn syntax_error_is_template_error() {
        let err = ChatTemplate::new("{% for %}").err().unwrap();
        assert!(matches!(err, Error::Template(_)));
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-07-23 13:05:09 UTC was a Tuesday.
        let t = 1_721_739_909;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "23 Jul 2024");
        assert_eq!(
            strftime("%A %B %H:%M:%S %j %%", t).unwrap(),
            "Tuesday July 13:05:09 205 %"
        );
        assert_eq!(strftime("%d %m %y", 0).unwrap(), "01 01 70");
    }

    fn conversation(n: usize, content: &str) -> Vec<Message> {
        (0..n)
            .map(|i| msg(if i % 2 == 0 { "user" } else { "assistant" }, content))
            .collect()
    }

    #[test]
    fn long_conversations_render_within_the_fuel_budget() {
        let msgs = conversation(5000, &"hello world ".repeat(100));
        for src in [SMOLLM2, LLAMA3] {
            let mut t = ChatTemplate::new(src).unwrap();
            let out = t
                .render(&msgs, true, Some("<s>"), None, usize::MAX)
                .unwrap();
            assert!(out.len() > 5000 * 1200, "{}", out.len());
        }
    }

    #[test]
    fn a_runaway_template_runs_out_of_fuel() {
        let t0 = std::time::Instant::now();
        for src in [
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            // Inside a macro call, too.
            "{% macro f() %}{% for i in range(100000) %}{% for j in range(100000) %}\
             {% endfor %}{% endfor %}{% endmacro %}{{ f() }}",
        ] {
            let mut t = ChatTemplate::new(src).unwrap();
            let msgs = [msg("user", "x")];
            let err = t.render(&msgs, true, None, None, usize::MAX).unwrap_err();
            let fuel = fuel_budget(&msgs);
            assert_eq!(fuel, FUEL_BASE + FUEL_PER_MESSAGE + FUEL_PER_BYTE * 16);
            assert!(
                matches!(err, RenderError::OutOfFuel(n) if n == fuel),
                "{err:?}"
            );
            let err = Error::from(err).to_string();
            assert!(err.contains("ran too long"), "{err}");
        }
        assert!(t0.elapsed().as_secs() < 20, "{:?}", t0.elapsed());
    }

    #[test]
    fn output_over_the_limit_stops_the_render() {
        // 100,000 copies of a 1 KB message would be 100 MB; the limit stops it at 1 MB.
        let src = "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}";
        let mut t = ChatTemplate::new(src).unwrap();
        let msgs = [msg("user", &"y".repeat(1000))];
        let err = t.render(&msgs, true, None, None, 1 << 20).unwrap_err();
        assert!(matches!(err, RenderError::OutputTooLong), "{err:?}");
        // Exactly at the limit is fine.
        let out = t.render(&msgs, true, None, None, 100_000_000).unwrap();
        assert_eq!(out.len(), 100_000_000);
        let src = "{{ messages[0].content }}";
        let mut t = ChatTemplate::new(src).unwrap();
        assert_eq!(t.render(&msgs, true, None, None, 1000).unwrap().len(), 1000);
        assert!(t.render(&msgs, true, None, None, 999).is_err());
    }

    /// This process's peak resident memory so far (VmHWM), in bytes.
    fn peak_rss() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
            .map_or(0, |kib| kib << 10)
    }

    #[test]
    fn templates_building_huge_values_stop_at_the_memory_limit() {
        let before = peak_rss();
        for src in [
            // 34 doublings would be 16 GiB: by `~`, `+`, a capture, a macro, a namespace.
            "{% set s = namespace(v='x') %}{% for i in range(34) %}{% set s.v = s.v ~ s.v %}\
             {% endfor %}{{ s.v }}",
            "{% set ns = namespace(v='x') %}{% for i in range(34) %}{% set ns.v = ns.v + ns.v %}\
             {% endfor %}{{ ns.v }}",
            "{% set ns = namespace(v='x') %}{% for i in range(34) %}{% set t %}{{ ns.v }}\
             {{ ns.v }}{% endset %}{% set ns.v = t %}{% endfor %}",
            "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}\
             {% endmacro %}{{ d('x', 34) }}",
            "{% set ns = namespace(v=['x']) %}{% for i in range(34) %}{% set ns.v = ns.v + ns.v \
             %}{% endfor %}{{ ns.v | list | length }}",
            // Many references to one string, written out in one step.
            "{% set s = 'x' * 10000000 %}{{ ([s] * 1000) | join }}",
            "{% set s = 'x' * 10000000 %}{{ ([s] * 1000) ~ '' }}",
            "{% set s = 'x' * 10000000 %}{{ [s] * 1000 }}",
            "{% set s = 'x' * 10000000 %}{{ ([s] * 1000) | string | length }}",
            "{% set s = 'x' * 10000000 %}{{ ([s] * 1000) | tojson | length }}",
            "{% set s = 'x' * 10000000 %}{{ ([s] * 1000) | upper | length }}",
            "{% set s = 'x' * 10000000 %}{{ ([s] * 1000) in 'x' }}",
            "{% set s = 'x' * 10000000 %}{{ ([s] * 1000) is in 'x' }}",
            "{% set s = 'x' * 10000000 %}{{ ([s] * 1000) is startingwith 'x' }}",
            "{% set n = 10000000000 %}{{ ([0] * n) | list | length }}",
            // A repeat whose length would wrap minijinja's unchecked `len * n` (to 0 here),
            // made at render time (constants folded at compile time are refused there).
            "{% set n = 2**63 %}{{ ([\"\", \"\"] * n) | list | length }}",
            "{% set e = '' %}{{ (2**63 * [e, e]) | join | length }}",
            // A size given as a number.
            "{{ 'x' | indent(100000000000) }}",
            "{{ ('x' * 1000) | replace('', 'y' * 10000000) | length }}",
            "{{ ('x' * 1000).replace('x', 'y' * 10000000) | length }}",
            "{% set a = 'a' %}{{ ('y' * 10000000).join([a] * 1000) | length }}",
            "{{ '{:>99999999999}'.format(1) }}",
            "{{ '%99999999999d' | format(1) }}",
            // Growth in a loop, each step small (a new 100 KB string per step).
            "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}\
             {% set ns.l = ns.l + [('x' * 100000) ~ i] %}{% endfor %}{{ ns.l | length }}",
        ] {
            let mut t = ChatTemplate::new(src).unwrap();
            let msgs = [msg("user", "hi")];
            let err = t.render(&msgs, true, None, None, 1 << 20).unwrap_err();
            assert!(matches!(err, RenderError::OutOfMemory(_)), "{src}: {err:?}");
            assert!(
                Error::from(err).to_string().contains("memory limit"),
                "{src}"
            );
        }
        let grown = peak_rss().saturating_sub(before);
        assert!(grown < 1 << 30, "peak RSS grew by {} MiB", grown >> 20);
    }

    /// Constant lists joined or repeated are folded by minijinja's compiler into lazy
    /// sequences no check can measure: refused at compile time; a constant list, a repeated
    /// string and a repeat at render time are not.
    #[test]
    fn constant_lazy_sequences_are_refused_when_compiled() {
        for src in [
            "{{ ([\"\", \"\"] * 2**63) | list | length }}",
            "{{ 2**63 * ['', ''] }}",
            "{% for x in [1] + [2] %}{{ x }}{% endfor %}",
        ] {
            let err = ChatTemplate::new(src).err().expect(src).to_string();
            assert!(err.contains("constant lists"), "{src}: {err}");
        }
        let src = "{% set n = 2 %}{{ [1, 2] | join }}{{ 'ab' * 2 }}{{ ([3] * n) | join }}";
        let mut t = ChatTemplate::new(src).unwrap();
        let out = t
            .render(&[msg("user", "hi")], true, None, None, 1000)
            .unwrap();
        assert_eq!(out, "12abab33");
    }

    /// `src` rendered by minijinja as compiled, unguarded, with the same settings.
    fn unguarded(src: &str, messages: &[Message]) -> String {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_template("t", src).unwrap();
        let ctx = context(messages, true, Some("<s>"), None);
        env.get_template("t").unwrap().render(ctx).unwrap()
    }

    #[test]
    fn guarded_code_renders_as_compiled() {
        // Jumps land where they did: loops, conditions, macros, loop.cycle, recursion, sets.
        let msgs = [msg("user", "x"), msg("assistant", "y z")];
        for src in [
            "{% macro m(x) %}<{{ x }}>{% endmacro %}{% for i in range(3) %}{% if i is even \
             and i > 0 %}{{ m(i) }}{% elif i == 1 %}one{% else %}z{% endif %}\
             {{ loop.cycle('a', 'b') }}{% endfor %}",
            "{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}[{{ loop(x) }}]\
             {% else %}{{ x }}{% endif %}{% endfor %}",
            "{{ 'a' ~ 1 ~ none }}{{ [1] + [y] }}{{ 'ab' * 2 }}{{ 2 * 3 }}{{ 1 + 2.5 }}\
             {% set x %}cap{{ 1 }}{% endset %}{{ x }}",
            "{{ (messages | map(attribute='role') | join(',')) | upper }}\
             {{ '{}-{}'.format(1, 2) }}{{ 'a b'.split() | length }}{{ messages | tojson }}\
             {{ 'x y' | replace('x', 'q') | indent(2, true) }}{{ [3, 1] | sort | list }}\
             {{ 'us' in 'user' }}{{ 1 in [1, 2] }}{{ 'role' in messages[0] }}{{ 3 not in [1] }}\
             {{ 'x' is in 'xy' }}{{ 'q' in messages[0] }}{{ [1] in 'a[1]' }}{{ y in nothing }}\
             {{ 'ab' is startingwith 'a' }}{{ 'ab' is endingwith 'a' }}{{ 1 is in 3 }}\
             {{ messages[0] | attr('role') }}",
            "{% for m in messages if m.role != 'system' %}{{ loop.index }}{{ m.content | trim }}\
             {% if not loop.last %},{% endif %}{% else %}none{% endfor %}{{ bos_token }}",
            SMOLLM2,
            LLAMA3,
        ] {
            let out = render_chat_template(src, &msgs, true, Some("<s>"), None).unwrap();
            assert_eq!(out, unguarded(src, &msgs), "{src}");
        }
    }

    #[test]
    fn float_repr() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e20), "1e+20");
        assert_eq!(python_float_repr(1.5e-5), "1.5e-05");
    }
}
