//! The memory a chat template render may use, bounded while it runs.
//!
//! minijinja's fuel bounds a render's instructions, not its values: `{% set s = s ~ s %}` in a
//! loop doubles a string per instruction (29 doublings: 512 MiB). Three parts bound it:
//!
//! * `MeteredAlloc`, the process allocator: the system's, also counting the bytes held by a
//!   thread while a `Metered` scope of that thread is open (allocations minus frees, on that
//!   thread: a render runs on one thread).
//! * checks after every instruction of the template that can allocate (chat_template.rs
//!   rewrites the compiled code): `check` fails the render once the scope holds more than its
//!   limit, and refuses a lazy sequence (`[x] * n`, `a + b`) of more items than fit the limit.
//! * measuring before writing out: a value written as text (`~`, `{{ }}`, `in` on a string,
//!   text filters and string methods) can be far larger than the memory it holds (a list of
//!   many references to one string), so its text is counted first against what is left.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Write as _;

use minijinja::value::Value;
use minijinja::{Error, ErrorKind};

/// The system allocator, counting a metered thread's bytes (see the module doc).
pub struct MeteredAlloc;

#[global_allocator]
static GLOBAL: MeteredAlloc = MeteredAlloc;

/// One thread's meter: whether a scope is open, the bytes it holds, its limit, and whether a
/// check has refused (the render's error is then the memory limit's).
#[derive(Clone, Copy)]
struct Meter {
    on: bool,
    live: isize,
    limit: usize,
    tripped: bool,
}

const OFF: Meter = Meter {
    on: false,
    live: 0,
    limit: 0,
    tripped: false,
};

thread_local! {
    // const-initialised and without Drop: reading it neither allocates nor registers a
    // destructor, so the allocator itself may use it.
    static METER: Cell<Meter> = const { Cell::new(OFF) };
}

fn charge(delta: isize) {
    let _ = METER.try_with(|m| {
        let mut v = m.get();
        if v.on {
            v.live = v.live.saturating_add(delta);
            m.set(v);
        }
    });
}

// SAFETY: every call is forwarded to `System` unchanged; the meter only counts sizes.
unsafe impl GlobalAlloc for MeteredAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            charge(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            charge(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        charge(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            charge(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// While alive, this thread's allocations count against `limit` bytes (a scope opened inside
/// another restores the outer one when it closes).
pub struct Metered {
    outer: Meter,
}

impl Metered {
    pub fn start(limit: usize) -> Self {
        let outer = METER.with(|m| {
            m.replace(Meter {
                on: true,
                live: 0,
                limit,
                tripped: false,
            })
        });
        Metered { outer }
    }

    /// Whether a check refused during this scope.
    pub fn tripped(&self) -> bool {
        METER.with(|m| m.get().tripped)
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        METER.with(|m| m.set(self.outer));
    }
}

/// Bytes left to this thread's scope (unbounded when none is open).
fn left() -> usize {
    let m = METER.with(Cell::get);
    if !m.on {
        return usize::MAX;
    }
    m.limit.saturating_sub(m.live.max(0) as usize)
}

/// The error of a refused step; marks the scope so the render reports the limit.
fn over(what: &str) -> Error {
    METER.with(|m| {
        let mut v = m.get();
        v.tripped = true;
        m.set(v);
    });
    Error::new(
        ErrorKind::InvalidOperation,
        format!("the chat template's memory limit: {what}"),
    )
}

/// Bytes a value may hold per item of a sequence (a `Value` and some slack): a lazy sequence
/// of more items than `left() / ITEM_BYTES` could not be listed within the limit.
const ITEM_BYTES: usize = 32;

/// The check run after each allocating instruction: fails once the scope holds more than
/// its limit, or when `v` (the instruction's result, or undefined) is a sequence or map of
/// more items than the limit could list; else `v` unchanged.
pub fn check(v: Value) -> Result<Value, Error> {
    let left = left();
    if left == 0 {
        return Err(over("the render holds more memory than its limit"));
    }
    if v.as_str().is_none() && v.len().is_some_and(|n| n > left / ITEM_BYTES) {
        return Err(over("a sequence has more items than fit the limit"));
    }
    Ok(v)
}

/// A `fmt::Write` that counts and fails once more than `left` bytes were written.
struct Counter {
    n: usize,
    left: usize,
}

impl std::fmt::Write for Counter {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.n = self.n.saturating_add(s.len());
        if self.n > self.left {
            return Err(std::fmt::Error);
        }
        Ok(())
    }
}

/// The length of `v` written as text when it fits in `left` bytes.
fn text_len(v: &Value, left: usize) -> Option<usize> {
    if let Some(s) = v.as_str() {
        return (s.len() <= left).then_some(s.len());
    }
    let mut c = Counter { n: 0, left };
    write!(c, "{v}").ok().map(|_| c.n)
}

/// Refuses when `values`, written as text together plus `extra` bytes, would not fit what is
/// left of the limit (strings count too: the text is a copy).
pub fn fits_as_text(values: &[Value], extra: usize, what: &str) -> Result<(), Error> {
    let mut left = left()
        .checked_sub(extra)
        .ok_or_else(|| over(&format!("{what} would be too long")))?;
    for v in values {
        let n = text_len(v, left).ok_or_else(|| over(&format!("{what} would be too long")))?;
        left -= n;
    }
    Ok(())
}

/// `~`: both sides written out, measured first.
pub fn concat(a: &Value, b: &Value) -> Result<Value, Error> {
    fits_as_text(&[a.clone(), b.clone()], 0, "a `~` result")?;
    Ok(Value::from(format!("{a}{b}")))
}

/// Items of `v` (characters of a string) when it is listed, refused past the limit.
pub fn fits_as_list(v: &Value, what: &str) -> Result<(), Error> {
    let n = match v.as_str() {
        Some(s) => s.chars().count(),
        None => v.len().unwrap_or(0),
    };
    if n.saturating_mul(ITEM_BYTES) > left() {
        return Err(over(&format!("{what} would have too many items")));
    }
    Ok(())
}

/// Before `a * b`: refuses a string or sequence repeated past the limit (its length times the
/// count, checked: minijinja multiplies a sequence's length unchecked, and a wrapped length
/// would pass every later check), else returns `[b, a]` for `UnpackList` to push back.
pub fn mul_operands(a: Value, b: Value) -> Result<Value, Error> {
    for (x, n) in [(&a, &b), (&b, &a)] {
        let Some(n) = n.as_usize() else {
            continue;
        };
        let per_item = if x.as_str().is_some() { 1 } else { ITEM_BYTES };
        let len = match (x.as_str(), x.as_object()) {
            (Some(s), _) => s.len(),
            (None, Some(_)) => x.len().unwrap_or(0),
            _ => continue,
        };
        let bytes = len.checked_mul(n).and_then(|k| k.checked_mul(per_item));
        if bytes.is_none_or(|b| b > left()) {
            return Err(over("a repeated string or sequence would not fit"));
        }
    }
    Ok(Value::from(vec![b, a]))
}

/// Occurrences of `pat` in `s` (`s.len() + 1` for an empty pattern, as `replace` counts).
fn occurrences(s: &str, pat: &str) -> usize {
    if pat.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(pat).count()
    }
}

/// `s.replace(from, to)` (at most `count` times) measured before it is built.
pub fn fits_replace(
    s: &Value,
    from: &Value,
    to: &Value,
    count: Option<usize>,
) -> Result<(), Error> {
    let (Some(s), Some(from)) = (s.as_str(), from.as_str()) else {
        return Ok(());
    };
    let n = occurrences(s, from).min(count.unwrap_or(usize::MAX));
    let to_len = text_len(to, left()).ok_or_else(|| over("a replace result would be too long"))?;
    let grown = n.saturating_mul(to_len).saturating_add(s.len());
    fits_as_text(&[], grown, "a replace result")
}

/// `sep.join(items)`: the items' text plus a separator between each two.
pub fn fits_join(items: &Value, sep: &str) -> Result<(), Error> {
    let Ok(iter) = items.try_iter() else {
        return Ok(());
    };
    let mut left = left();
    for (i, item) in iter.enumerate() {
        let n = text_len(&item, left)
            .and_then(|n| n.checked_add(if i > 0 { sep.len() } else { 0 }))
            .filter(|&n| n <= left)
            .ok_or_else(|| over("a join result would be too long"))?;
        left -= n;
    }
    Ok(())
}

/// `indent(width)`: every line gains the indent (a number of spaces or a string).
pub fn fits_indent(text: &Value, width: &Value) -> Result<(), Error> {
    let lines = text.as_str().map_or(1, |s| s.lines().count() + 1);
    let per_line = match width.as_str() {
        Some(s) => s.len(),
        None => width.as_usize().unwrap_or(0),
    };
    fits_as_text(
        std::slice::from_ref(text),
        lines.saturating_mul(per_line),
        "an indent result",
    )
}

/// A format string's widths and precisions (`%10s`, `{:>10}`): any number in it over what is
/// left of the limit is refused (it would pad the result to that size).
pub fn fits_format_widths(fmt: &Value) -> Result<(), Error> {
    let Some(fmt) = fmt.as_str() else {
        return Ok(());
    };
    let left = left();
    let too_wide = fmt
        .split(|c: char| !c.is_ascii_digit())
        .any(|d| !d.is_empty() && d.parse::<usize>().map_or(true, |n| n > left));
    if too_wide {
        return Err(over("a format width would be too large"));
    }
    Ok(())
}

/// The filter `guarded` code calls after an instruction (`check`), and the one `~` becomes
/// (`concat`). Names with a colon: no template can write them, so none can shadow them.
pub const CHECK_FILTER: &str = "eb:check";
pub const CONCAT_FILTER: &str = "eb:concat";
pub const MUL_OPERANDS_FILTER: &str = "eb:mul";
pub const IN_FILTER: &str = "eb:in";

/// `needle in container`, as minijinja's operator: a string container writes a needle that is
/// not a string as text (measured first); other containers are searched as minijinja does.
pub fn contains(needle: &Value, container: &Value) -> Result<Value, Error> {
    if container.is_undefined() {
        return Ok(Value::from(false));
    }
    if let Some(s) = container.as_str() {
        if let Some(n) = needle.as_str() {
            return Ok(Value::from(s.contains(n)));
        }
        fits_as_text(std::slice::from_ref(needle), 0, "an `in` operand")?;
        return Ok(Value::from(s.contains(&needle.to_string())));
    }
    use minijinja::value::ValueKind as K;
    match container.kind() {
        K::Map => {
            let found = container.as_object().and_then(|o| o.get_value(needle));
            return Ok(Value::from(found.is_some()));
        }
        K::Seq | K::Iterable => {
            let mut items = container.try_iter()?;
            return Ok(Value::from(items.any(|v| &v == needle)));
        }
        K::Plain => return Ok(Value::from(false)),
        _ => {}
    }
    Err(Error::new(
        ErrorKind::InvalidOperation,
        "cannot perform a containment check on this value",
    ))
}

/// How a wrapped builtin filter is measured before it runs.
#[derive(Clone, Copy)]
enum Measure {
    /// Its arguments written as text (it copies them into a string).
    Text,
    /// Its input as a list of items (it lists a string's characters or a sequence's items).
    List,
    Join,
    Indent,
    Replace,
    Format,
}

/// Refuses `args` (the filter's input first) that `m` says would not fit the limit.
fn measure(m: Measure, name: &str, args: &[Value]) -> Result<(), Error> {
    let arg = |i: usize| args.get(i).cloned().unwrap_or(Value::UNDEFINED);
    match m {
        Measure::Text => fits_as_text(args, 0, name),
        Measure::List => fits_as_list(&arg(0), name),
        Measure::Join => fits_join(&arg(0), arg(1).as_str().unwrap_or("")),
        Measure::Indent => {
            let kw_width = args.last().and_then(|v| v.get_attr("width").ok());
            let width = match (args.get(1), kw_width) {
                (_, Some(w)) if !w.is_undefined() => w,
                (Some(w), _) if w.kind() != minijinja::value::ValueKind::Map => w.clone(),
                _ => Value::from(4),
            };
            fits_indent(&arg(0), &width)
        }
        Measure::Replace => fits_replace(&arg(0), &arg(1), &arg(2), arg(3).as_usize()),
        Measure::Format => fits_format_widths(&arg(0)).and_then(|_| fits_as_text(args, 0, name)),
    }
}

/// Registers builtin filter `$f` under a name no template can write ("eb:NAME") and, under its
/// own name, a wrapper that measures its arguments first and then calls it.
macro_rules! wrap_filters {
    ($env:ident, $($name:literal => $f:path, $m:expr;)*) => {
        $(
            $env.add_filter(concat!("eb:", $name), $f);
            $env.add_filter(
                $name,
                |state: &minijinja::State,
                 args: minijinja::value::Rest<Value>|
                 -> Result<Value, Error> {
                    measure($m, concat!("the ", $name, " filter's result"), &args)?;
                    state.apply_filter(concat!("eb:", $name), &args)
                },
            );
        )*
    };
}

/// Adds the checks to `env`: `check` and `concat` for guarded code, a measuring formatter, the
/// text and list filters wrapped, and string methods measured (see the module doc).
pub fn install(env: &mut minijinja::Environment<'static>) {
    env.add_filter(CHECK_FILTER, check);
    env.add_filter(CONCAT_FILTER, concat);
    env.add_filter(MUL_OPERANDS_FILTER, mul_operands);
    env.add_filter(IN_FILTER, contains);
    env.add_test(
        "in",
        |state: &minijinja::State, needle: &Value, container: &Value| {
            if container.as_str().is_some() && needle.as_str().is_none() {
                fits_as_text(std::slice::from_ref(needle), 0, "an `in` operand")?;
            }
            minijinja::tests::is_in(state, needle, container)
        },
    );
    env.add_test("startingwith", |v: &Value, other: &Value| {
        fits_as_text(&[v.clone(), other.clone()], 0, "a startingwith operand")?;
        Ok::<_, Error>(minijinja::tests::is_startingwith(
            v.to_string().into(),
            other.to_string().into(),
        ))
    });
    env.add_test("endingwith", |v: &Value, other: &Value| {
        fits_as_text(&[v.clone(), other.clone()], 0, "an endingwith operand")?;
        Ok::<_, Error>(minijinja::tests::is_endingwith(
            v.to_string().into(),
            other.to_string().into(),
        ))
    });
    env.set_formatter(|out, state, v| {
        fits_as_text(std::slice::from_ref(v), 0, "an output value")?;
        minijinja::escape_formatter(out, state, v)
    });
    env.set_unknown_method_callback(|state, value, method, args| {
        measure_method(value, method, args)?;
        minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
    });
    install_filters(env);
}

/// The builtin text and list filters, each measuring its arguments before it runs.
fn install_filters(env: &mut minijinja::Environment<'static>) {
    use minijinja::filters as f;
    wrap_filters!(env,
        "lower" => f::lower, Measure::Text;
        "upper" => f::upper, Measure::Text;
        "title" => f::title, Measure::Text;
        "capitalize" => f::capitalize, Measure::Text;
        "trim" => f::trim, Measure::Text;
        "string" => f::string, Measure::Text;
        "safe" => f::safe, Measure::Text;
        "escape" => f::escape, Measure::Text;
        "e" => f::escape, Measure::Text;
        "pprint" => f::pprint, Measure::Text;
        "attr" => f::attr, Measure::Text;
        "split" => f::split, Measure::List;
        "lines" => f::lines, Measure::List;
        "striptags" => minijinja_contrib::filters::striptags, Measure::Text;
        "truncate" => minijinja_contrib::filters::truncate, Measure::Text;
        "join" => f::join, Measure::Join;
        "indent" => f::indent, Measure::Indent;
        "replace" => f::replace, Measure::Replace;
        "format" => f::format, Measure::Format;
        "list" => f::list, Measure::List;
        "batch" => f::batch, Measure::List;
        "slice" => f::slice, Measure::List;
        "sort" => f::sort, Measure::List;
        "reverse" => f::reverse, Measure::List;
        "unique" => f::unique, Measure::List;
    );
}

/// A Python string method (pycompat) measured like the filter it matches.
fn measure_method(value: &Value, method: &str, args: &[Value]) -> Result<(), Error> {
    let Some(s) = value.as_str() else {
        return Ok(());
    };
    let arg = |i: usize| args.get(i).cloned().unwrap_or(Value::UNDEFINED);
    let what = "a string method's result";
    match method {
        "join" => fits_join(&arg(0), s),
        "replace" => fits_replace(value, &arg(0), &arg(1), arg(2).as_usize()),
        "format" => fits_format_widths(value).and_then(|_| fits_as_text(args, s.len(), what)),
        "split" | "splitlines" => fits_as_list(value, what),
        _ => fits_as_text(std::slice::from_ref(value), 0, what),
    }
}
