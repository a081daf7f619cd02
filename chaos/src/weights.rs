//! Compares the final model weights of two runs, tensor by tensor.
//!
//! A run whose world size changed sums gradients in a different order than the fault-free
//! reference, so its weights cannot be bitwise equal; they must stay within a relative
//! tolerance. Both sides are the newest committed checkpoint as the checkpoint crate restores it
//! for one rank of a world of one (`state.safetensors`: every tensor whole), so the comparison
//! also goes through the format end to end.

use std::path::Path;

use anyhow::{Context, Result, bail};
use safetensors::{Dtype, SafeTensors};

/// The file a restore for one rank writes.
pub const STATE_FILE: &str = "state.safetensors";
/// Prefixes of the model's tensors in a worker-client checkpoint: `elastic_run.save(step,
/// {"model": m, ...})` names them `state/model/<name>`, the older `save(step, model=m)` and the
/// tch worker `model/<name>`.
pub const MODEL_PREFIXES: [&str; 2] = ["state/model/", "model/"];
/// Largest state file read for a comparison.
const STATE_BYTES_MAX: u64 = 1 << 30;

/// How far one run's model weights are from the reference's.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WeightsDiff {
    /// Model tensors compared.
    pub tensors: usize,
    /// The largest `max|a - b| / max|b|` over the tensors.
    pub max_rel_diff: f64,
    /// The tensor it was found in.
    pub worst: String,
}

fn read_state(dir: &Path) -> Result<Vec<u8>> {
    let p = dir.join(STATE_FILE);
    let len = std::fs::metadata(&p)
        .with_context(|| format!("{}", p.display()))?
        .len();
    if len > STATE_BYTES_MAX {
        bail!(
            "{}: {len} bytes, over the {STATE_BYTES_MAX} bytes compared",
            p.display()
        );
    }
    std::fs::read(&p).with_context(|| format!("read {}", p.display()))
}

fn f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// Compares the model tensors of `run` against `reference` (two restore directories). Every
/// reference model tensor must exist in `run` with the same dtype and shape; F32 tensors are
/// compared by relative difference, others must be equal bytes.
pub fn compare(run: &Path, reference: &Path) -> Result<WeightsDiff> {
    let (a_bytes, b_bytes) = (read_state(run)?, read_state(reference)?);
    let a = SafeTensors::deserialize(&a_bytes)
        .with_context(|| format!("{}", run.join(STATE_FILE).display()))?;
    let b = SafeTensors::deserialize(&b_bytes)
        .with_context(|| format!("{}", reference.join(STATE_FILE).display()))?;
    let mut names: Vec<String> = b
        .names()
        .into_iter()
        .filter(|n| MODEL_PREFIXES.iter().any(|p| n.starts_with(p)))
        .map(|n| n.to_string())
        .collect();
    names.sort();
    if names.is_empty() {
        bail!(
            "{}: no model tensors (`{}`) to compare",
            reference.display(),
            MODEL_PREFIXES.join("` or `")
        );
    }
    let mut out = WeightsDiff {
        tensors: 0,
        max_rel_diff: 0.0,
        worst: String::new(),
    };
    for name in names {
        let tb = b.tensor(&name)?;
        let ta = a
            .tensor(&name)
            .with_context(|| format!("tensor {name} is missing from {}", run.display()))?;
        if ta.dtype() != tb.dtype() || ta.shape() != tb.shape() {
            bail!(
                "tensor {name}: {:?} {:?} against the reference's {:?} {:?}",
                ta.dtype(),
                ta.shape(),
                tb.dtype(),
                tb.shape()
            );
        }
        let rel = if tb.dtype() == Dtype::F32 {
            let mut diff = 0f64;
            let mut scale = 0f64;
            for (x, y) in f32s(ta.data()).zip(f32s(tb.data())) {
                let d = (f64::from(x) - f64::from(y)).abs();
                // NaN anywhere makes the comparison fail, never pass.
                diff = if d.is_nan() {
                    f64::INFINITY
                } else {
                    diff.max(d)
                };
                scale = scale.max(f64::from(y).abs());
            }
            if diff == 0.0 {
                0.0
            } else {
                diff / scale.max(f64::MIN_POSITIVE)
            }
        } else if ta.data() == tb.data() {
            0.0
        } else {
            f64::INFINITY
        };
        out.tensors += 1;
        if out.worst.is_empty() || rel > out.max_rel_diff {
            out.max_rel_diff = rel;
            out.worst = name;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write(dir: &Path, tensors: &[(&str, Vec<f32>)]) {
        std::fs::create_dir_all(dir).unwrap();
        let bytes: Vec<(String, Vec<u8>, usize)> = tensors
            .iter()
            .map(|(n, v)| {
                (
                    n.to_string(),
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    v.len(),
                )
            })
            .collect();
        let views: Vec<(String, TensorView)> = bytes
            .iter()
            .map(|(n, b, len)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::F32, vec![*len], b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(STATE_FILE)).unwrap();
    }

    #[test]
    fn equal_close_and_far_weights() {
        let t = tempfile::tempdir().unwrap();
        let (r, a) = (t.path().join("ref"), t.path().join("run"));
        write(
            &r,
            &[
                ("model/w", vec![1.0, -2.0, 0.5]),
                ("optim/state/0/m", vec![9.0]),
            ],
        );
        write(
            &a,
            &[
                ("model/w", vec![1.0, -2.0, 0.5]),
                ("optim/state/0/m", vec![3.0]),
            ],
        );
        let d = compare(&a, &r).unwrap();
        assert_eq!(
            (d.tensors, d.max_rel_diff),
            (1, 0.0),
            "only model tensors count"
        );

        write(&a, &[("model/w", vec![1.0, -2.0002, 0.5])]);
        let d = compare(&a, &r).unwrap();
        assert!((d.max_rel_diff - 1e-4).abs() < 1e-6, "{d:?}");
        assert_eq!(d.worst, "model/w");

        write(&a, &[("model/w", vec![1.0, f32::NAN, 0.5])]);
        assert!(compare(&a, &r).unwrap().max_rel_diff.is_infinite());

        write(&a, &[("model/w", vec![1.0, -2.0])]);
        let e = compare(&a, &r).unwrap_err().to_string();
        assert!(e.contains("model/w"), "{e}");
        write(&a, &[("model/v", vec![1.0, -2.0, 0.5])]);
        let e = format!("{:#}", compare(&a, &r).unwrap_err());
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn the_state_mapping_forms_model_tensors_are_compared_and_others_are_not() {
        let t = tempfile::tempdir().unwrap();
        let (r, a) = (t.path().join("ref"), t.path().join("run"));
        let other = ("state/opt/state/~0/momentum_buffer", vec![1.0]);
        write(
            &r,
            &[("state/model/0.weight", vec![1.0, 2.0]), other.clone()],
        );
        write(
            &a,
            &[
                ("state/model/0.weight", vec![1.0, 2.0002]),
                ("state/opt/state/~0/momentum_buffer", vec![7.0]),
            ],
        );
        let d = compare(&a, &r).unwrap();
        assert_eq!((d.tensors, d.worst.as_str()), (1, "state/model/0.weight"));
        assert!((d.max_rel_diff - 1e-4).abs() < 1e-6, "{d:?}");
        write(&r, &[other]);
        let e = compare(&a, &r).unwrap_err().to_string();
        assert!(e.contains("no model tensors"), "{e}");
    }
}
