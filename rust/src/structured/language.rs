//! Whether a compiled grammar's language is empty: no finite text matches it in full.
//!
//! A grammar is productive when its start symbol derives a string of terminals: the classic
//! fixpoint over the rules reachable from the start (a symbol is productive when it is nullable,
//! or one of its rules has only terminals and productive symbols). Over-approximate by design:
//! every lexeme counts as productive (an empty lexeme is caught at the start's mask instead) and
//! so do nested grammars and parametric conditions, so a grammar called empty here is empty.

use std::collections::HashSet;

use llguidance::earley::{CGrammar, CSymIdx};

/// True when no text derives from `g`'s start symbol (`start: start`, `start: "a" start`,
/// `a: b` with `b: a`).
pub fn is_empty(g: &CGrammar) -> bool {
    let symbols = reachable(g);
    let mut productive: HashSet<CSymIdx> = HashSet::new();
    loop {
        let before = productive.len();
        for &s in &symbols {
            if !productive.contains(&s) && derives_text(g, s, &productive) {
                productive.insert(s);
            }
        }
        if productive.len() == before {
            return !productive.contains(&g.start());
        }
    }
}

/// The nonterminals reachable from the start (terminals need no fixpoint: they are text).
fn reachable(g: &CGrammar) -> Vec<CSymIdx> {
    let mut seen = HashSet::from([g.start()]);
    let mut stack = vec![g.start()];
    let mut out = Vec::new();
    while let Some(s) = stack.pop() {
        if is_leaf(g, s) {
            continue;
        }
        out.push(s);
        for &rule in g.rules_of(s) {
            for &t in g.rule_rhs(rule).0 {
                if seen.insert(t) {
                    stack.push(t);
                }
            }
        }
    }
    out
}

/// Symbols taken as deriving text without looking inside: lexemes and nested grammars.
fn is_leaf(g: &CGrammar, s: CSymIdx) -> bool {
    let d = g.sym_data(s);
    d.is_terminal || d.gen_grammar.is_some()
}

fn derives_text(g: &CGrammar, s: CSymIdx, productive: &HashSet<CSymIdx>) -> bool {
    let d = g.sym_data(s);
    if d.is_nullable || !d.cond_nullable.is_empty() {
        return true;
    }
    d.rules.iter().any(|&rule| {
        g.rule_rhs(rule)
            .0
            .iter()
            .all(|&t| is_leaf(g, t) || productive.contains(&t))
    })
}
