//! Progress counters and the end-of-run summary.
//!
//! Latency samples are kept in fixed-size reservoirs (exact up to `RESERVOIR` rows, a uniform
//! sample beyond), so memory stays bounded however many rows a job has.

use std::collections::BTreeMap;

/// Samples kept per metric for percentiles.
const RESERVOIR: usize = 1 << 20;

/// Uniform reservoir sample of f64 values (Algorithm R with a deterministic xorshift RNG).
#[derive(Debug, Clone)]
pub struct Reservoir {
    samples: Vec<f64>,
    seen: u64,
    capacity: usize,
    rng: u64,
}

impl Reservoir {
    pub fn new(capacity: usize) -> Self {
        Reservoir {
            samples: Vec::new(),
            seen: 0,
            capacity: capacity.max(1),
            rng: 0x9E37_79B9_7F4A_7C15,
        }
    }

    pub fn push(&mut self, v: f64) {
        self.seen += 1;
        if self.samples.len() < self.capacity {
            self.samples.push(v);
            return;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let j = self.rng % self.seen;
        if (j as usize) < self.capacity {
            self.samples[j as usize] = v;
        }
    }

    /// Percentile `q` in [0, 100] with linear interpolation (numpy's default); None if empty.
    pub fn percentile(&self, q: f64) -> Option<f64> {
        if self.samples.is_empty() {
            return None;
        }
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        let pos = (q / 100.0).clamp(0.0, 1.0) * (s.len() - 1) as f64;
        let lo = pos.floor() as usize;
        let hi = pos.ceil() as usize;
        Some(s[lo] + (s[hi] - s[lo]) * (pos - lo as f64))
    }
}

/// Counters maintained by the scheduler (single-threaded: no atomics needed).
#[derive(Debug, Clone)]
pub struct Stats {
    /// Rows this run generates: the input rows less those done by an earlier run.
    pub requests_total: u64,
    /// Input rows skipped because an earlier run of the job already wrote them.
    pub requests_skipped: u64,
    /// Rows handed to the writer (finished or failed).
    pub requests_done: u64,
    pub requests_error: u64,
    /// Requests read from the input by this run (error rows included), and the prompt tokens
    /// of those queued to run (a scored row: all its parts'): with requests_total, what is
    /// still to prefill (the progress line's ETA).
    pub requests_read: u64,
    pub prompt_tokens_read: u64,
    /// Rows finished without error, those ended by a stop (EOS, stop string or id, grammar
    /// end), and their output tokens: how long outputs run (the ETA).
    pub requests_stopped: u64,
    pub finished_output_tokens: u64,
    /// Prompt tokens of requests admitted for the first time.
    pub prompt_tokens: u64,
    /// Output tokens committed (including EOS tokens).
    pub output_tokens: u64,
    pub preemptions: u64,
    /// Prompt tokens served from the prefix cache at first admission; tokens computed by
    /// prefill rows (recomputations after preemption included); cached blocks evicted.
    pub cached_tokens: u64,
    pub prefill_tokens: u64,
    pub evictions: u64,
    /// Speculative decoding: verify rounds, accepted draft tokens, tokens from verify rounds.
    pub spec_steps: u64,
    pub accepted_tokens: u64,
    pub spec_tokens: u64,
    pub latency: Reservoir,
    pub ttft: Reservoir,
    pub tpot: Reservoir,
    /// Structured output: rows with a response_format, grammars compiled, and the seconds each
    /// step spent computing token masks (steps with a constrained row).
    pub structured_rows: u64,
    pub grammar_compiles: u64,
    pub mask_seconds: Reservoir,
}

impl Stats {
    pub fn new(requests_total: u64) -> Self {
        Stats {
            requests_total,
            requests_skipped: 0,
            requests_done: 0,
            requests_error: 0,
            requests_read: 0,
            prompt_tokens_read: 0,
            requests_stopped: 0,
            finished_output_tokens: 0,
            prompt_tokens: 0,
            output_tokens: 0,
            preemptions: 0,
            cached_tokens: 0,
            prefill_tokens: 0,
            evictions: 0,
            spec_steps: 0,
            accepted_tokens: 0,
            spec_tokens: 0,
            latency: Reservoir::new(RESERVOIR),
            ttft: Reservoir::new(RESERVOIR),
            tpot: Reservoir::new(RESERVOIR),
            structured_rows: 0,
            grammar_compiles: 0,
            mask_seconds: Reservoir::new(RESERVOIR),
        }
    }
}

/// A summary value: the Python side turns these into int / float / None / list[str].
#[derive(Debug, Clone, PartialEq)]
pub enum SummaryValue {
    Int(i64),
    Float(Option<f64>),
    Paths(Vec<String>),
}

pub type Summary = BTreeMap<String, SummaryValue>;

impl Stats {
    pub fn summary(&self, part_files: Vec<String>) -> Summary {
        let mut s = Summary::new();
        let int = |v: u64| SummaryValue::Int(v as i64);
        s.insert("requests".into(), int(self.requests_done));
        s.insert("errors".into(), int(self.requests_error));
        s.insert("skipped".into(), int(self.requests_skipped));
        s.insert("prompt_tokens".into(), int(self.prompt_tokens));
        s.insert("output_tokens".into(), int(self.output_tokens));
        s.insert("preemptions".into(), int(self.preemptions));
        s.insert("cached_tokens".into(), int(self.cached_tokens));
        s.insert("prefill_tokens".into(), int(self.prefill_tokens));
        s.insert("evictions".into(), int(self.evictions));
        let hit =
            (self.prompt_tokens > 0).then(|| self.cached_tokens as f64 / self.prompt_tokens as f64);
        s.insert("prefix_hit_rate".into(), SummaryValue::Float(hit));
        s.insert("spec_steps".into(), int(self.spec_steps));
        s.insert("accepted_tokens".into(), int(self.accepted_tokens));
        s.insert("spec_tokens".into(), int(self.spec_tokens));
        s.insert("structured_rows".into(), int(self.structured_rows));
        s.insert("grammar_compiles".into(), int(self.grammar_compiles));
        for (name, r, qs) in [
            ("latency", &self.latency, &[50.0, 90.0, 99.0][..]),
            ("ttft", &self.ttft, &[50.0, 99.0][..]),
            ("tpot", &self.tpot, &[50.0, 99.0][..]),
            ("mask_seconds", &self.mask_seconds, &[50.0, 99.0][..]),
        ] {
            for &q in qs {
                s.insert(format!("{name}_p{q}"), SummaryValue::Float(r.percentile(q)));
            }
        }
        s.insert("part_files".into(), SummaryValue::Paths(part_files));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_match_numpy_linear() {
        let mut r = Reservoir::new(100);
        for v in [4.0, 1.0, 3.0, 2.0] {
            r.push(v);
        }
        assert_eq!(r.percentile(50.0), Some(2.5));
        assert_eq!(r.percentile(0.0), Some(1.0));
        assert_eq!(r.percentile(100.0), Some(4.0));
        assert!((r.percentile(90.0).unwrap() - 3.7).abs() < 1e-12);
        assert_eq!(Reservoir::new(4).percentile(50.0), None);
    }

    #[test]
    fn reservoir_is_bounded() {
        let mut r = Reservoir::new(10);
        for i in 0..1000 {
            r.push(i as f64);
        }
        assert_eq!(r.samples.len(), 10);
        assert_eq!(r.seen, 1000);
    }

    #[test]
    fn summary_keys() {
        let s = Stats::new(3).summary(vec!["a".into()]);
        for k in [
            "requests",
            "errors",
            "prompt_tokens",
            "output_tokens",
            "preemptions",
            "latency_p50",
            "latency_p90",
            "latency_p99",
            "ttft_p50",
            "ttft_p99",
            "tpot_p50",
            "tpot_p99",
            "part_files",
        ] {
            assert!(s.contains_key(k), "missing {k}");
        }
        assert_eq!(s["latency_p50"], SummaryValue::Float(None));
    }
}
