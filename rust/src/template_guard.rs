//! The guarded code of a chat template (chat_template.rs): minijinja's compiled instructions
//! with a memory check (template_memory.rs) after every instruction that can allocate, and `~`
//! / `in` replaced by filters that measure the text they write. Uses minijinja's
//! `unstable_machinery` API, so minijinja is pinned exactly (Cargo.toml).

use minijinja::machinery::{Instruction, Instructions};
use minijinja::value::{ObjectRepr, Value};

use crate::template_memory;

/// What runs after an instruction: nothing, a check of the value it pushed, or a check that
/// leaves the stack as it is.
#[derive(Clone, Copy, PartialEq)]
enum Guard {
    None,
    Value,
    Neutral,
}

const CHECK: &str = template_memory::CHECK_FILTER;
const CONCAT: &str = template_memory::CONCAT_FILTER;
const IN: &str = template_memory::IN_FILTER;
const MUL: &str = template_memory::MUL_OPERANDS_FILTER;

/// What runs before `instr`: for `*`, its two operands measured (a repeat whose length would
/// not fit the limit, or would overflow minijinja's unchecked `len * n`, is refused before it
/// exists) and put back in their order (the filter returns them reversed, as `UnpackList`
/// pushes a list's items last-first).
fn pre(instr: &Instruction) -> Vec<Instruction<'static>> {
    match instr {
        Instruction::Mul => vec![
            Instruction::ApplyFilter(MUL, Some(2), !0),
            Instruction::UnpackList(2),
        ],
        _ => vec![],
    }
}

/// The guard after `instr`: a value check after the operators that can build a lazy
/// sequence (`+`, `*`) and after `~`; a neutral check after every other instruction that can
/// allocate or repeat (output, calls, lookups that copy, builders, loop steps); none after
/// control flow and stack moves.
fn guard(instr: &Instruction) -> Guard {
    use Instruction as I;
    match instr {
        I::Add | I::Mul | I::StringConcat | I::In => Guard::Value,
        I::EmitRaw(_)
        | I::Emit
        | I::GetAttr(_)
        | I::SetAttr(_)
        | I::GetItem
        | I::Slice
        | I::BuildMap(_)
        | I::BuildKwargs(_)
        | I::MergeKwargs(_)
        | I::BuildList(_)
        | I::UnpackList(_)
        | I::UnpackLists(_)
        | I::ApplyFilter(..)
        | I::PerformTest(..)
        | I::CallFunction(..)
        | I::CallMethod(..)
        | I::CallObject(_)
        | I::FastSuper
        | I::FastRecurse
        | I::CallBlock(_)
        | I::Include(_)
        | I::EndCapture
        | I::PushLoop(_)
        | I::Iterate(_) => Guard::Neutral,
        _ => Guard::None,
    }
}

/// The instructions a guard adds.
fn guard_code(g: Guard) -> Vec<Instruction<'static>> {
    let check = Instruction::ApplyFilter(CHECK, Some(1), !0);
    match g {
        Guard::None => vec![],
        Guard::Value => vec![check],
        Guard::Neutral => vec![
            Instruction::LoadConst(Value::UNDEFINED),
            check,
            Instruction::DiscardTop,
        ],
    }
}

/// `instr` with its jump target (an index of the old code) moved to `at[target]`, and `~` and
/// `in` turned into their measuring filters (the same two operands, in the same order).
fn moved(instr: &Instruction<'static>, at: &[u32]) -> Instruction<'static> {
    use Instruction as I;
    let to = |t: &u32| at[*t as usize];
    match instr {
        I::Jump(t) => I::Jump(to(t)),
        I::JumpIfFalse(t) => I::JumpIfFalse(to(t)),
        I::JumpIfFalseOrPop(t) => I::JumpIfFalseOrPop(to(t)),
        I::JumpIfTrueOrPop(t) => I::JumpIfTrueOrPop(to(t)),
        I::Iterate(t) => I::Iterate(to(t)),
        I::BuildMacro(name, t, flags) => I::BuildMacro(name, to(t), *flags),
        I::StringConcat => I::ApplyFilter(CONCAT, Some(2), !0),
        I::In => I::ApplyFilter(IN, Some(2), !0),
        other => other.clone(),
    }
}

/// Whether `code` loads a lazy sequence constant: minijinja folds `+` and `*` of constants
/// at compile time (`["", ""] * 2**63`), and such a value's length is computed unchecked when
/// first asked (it wraps, or panics in a debug build), so no check can measure it.
pub fn has_lazy_constant(code: &Instructions<'static>) -> bool {
    (0..code.len() as u32)
        .filter_map(|i| code.get(i))
        .any(|instr| {
            matches!(instr, Instruction::LoadConst(v)
            if v.as_object().is_some_and(|o| o.repr() == ObjectRepr::Iterable))
        })
}

/// `code` with each instruction's guard after it (and `pre` code before it). Invariant: every
/// jump lands on the instruction it landed on before, or on its `pre` code (targets are moved
/// by the instructions added before them), so the template runs as compiled, checked between
/// instructions.
pub fn guarded(code: &Instructions<'static>) -> Instructions<'static> {
    let n = code.len() as u32;
    let instrs: Vec<&Instruction<'static>> = (0..n).filter_map(|i| code.get(i)).collect();
    let mut at = Vec::with_capacity(instrs.len() + 1);
    let mut next = 0u32;
    for instr in &instrs {
        at.push(next);
        next += (pre(instr).len() + 1 + guard_code(guard(instr)).len()) as u32;
    }
    at.push(next); // a jump to the end stays at the end
    let mut out = Instructions::new(code.name(), code.source());
    for (i, instr) in instrs.iter().enumerate() {
        let line = code.get_line(i as u32).unwrap_or(0).min(u16::MAX as usize) as u16;
        for p in pre(instr) {
            out.add_with_line(p, line);
        }
        out.add_with_line(moved(instr, &at), line);
        for g in guard_code(guard(instr)) {
            out.add_with_line(g, line);
        }
    }
    out
}
