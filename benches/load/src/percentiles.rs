//! Latency percentiles (nearest rank) of samples in ms. No samples means no
//! figures: `null` in the evidence and `n/a` in the summary lines, never 0.

use serde_json::{json, Value};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    pub samples: usize,
    /// `[p50, p99, p99.9, max]`, `None` without samples.
    figures: Option<[f64; 4]>,
}

impl Percentiles {
    pub fn of(mut ms: Vec<f64>) -> Self {
        ms.sort_by(f64::total_cmp);
        let rank = |q: f64| ((ms.len() as f64 * q).ceil() as usize).clamp(1, ms.len()) - 1;
        let round = |x: f64| (x * 100.0).round() / 100.0;
        let figures = (!ms.is_empty()).then(|| [0.50, 0.99, 0.999, 1.0].map(|q| round(ms[rank(q)])));
        Self { samples: ms.len(), figures }
    }

    pub fn json(&self) -> Value {
        let at = |i: usize| self.figures.map(|f| f[i]);
        json!({"p50": at(0), "p99": at(1), "p999": at(2), "max": at(3), "samples": self.samples})
    }

    /// `p50 … p99 … max … ms`, or `n/a (no samples)`.
    pub fn text(&self) -> String {
        match self.figures {
            Some([p50, p99, _, max]) => format!("p50 {p50:.1} p99 {p99:.1} max {max:.1} ms"),
            None => "n/a (no samples)".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Percentiles;

    #[test]
    fn no_samples_give_no_figures() {
        let p = Percentiles::of(vec![]);
        assert_eq!(p.json()["p50"], serde_json::Value::Null);
        assert_eq!(p.json()["max"], serde_json::Value::Null);
        assert_eq!(p.text(), "n/a (no samples)");
    }

    #[test]
    fn figures_are_nearest_rank() {
        let p = Percentiles::of((1..=100).rev().map(f64::from).collect());
        assert_eq!(p.json()["p50"], 50.0);
        assert_eq!(p.json()["p99"], 99.0);
        assert_eq!(p.json()["max"], 100.0);
    }
}
