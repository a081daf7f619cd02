//! Saving and loading `tch` models through [`worker::Worker`]. Links the libtorch shipped in
//! PyPI `torch==2.13.0` (`LIBTORCH_USE_PYTORCH=1`); its build script puts an rpath to it into
//! the binaries of this crate.
//!
//! The model is a `VarStore`; the optimizer state is a second `VarStore` (tch's libtorch
//! optimizers do not expose their state, so a checkpointable optimizer keeps its buffers as
//! variables: see `examples/tch_train.rs`). Tensors are stored as `model/<name>` and
//! `optim/<name>`, in the same snapshot format as the Python client.

use ::tch::{Device, Kind, Tensor, nn::VarStore};
use safetensors::Dtype;
use serde_json::Value;

use worker::{SnapshotTensor, Worker, WorkerError};

fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        _ => return None,
    })
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        _ => return None,
    })
}

fn snapshot(prefix: &str, vs: &VarStore, out: &mut Vec<SnapshotTensor>) -> Result<(), WorkerError> {
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, t) in vars {
        let full = format!("{prefix}/{name}");
        let bad = |reason: String| WorkerError::Format {
            path: full.clone().into(),
            reason,
        };
        let kind = t.kind();
        let dtype = dtype_of(kind).ok_or_else(|| bad(format!("unsupported kind {kind:?}")))?;
        let t = t.detach().to_device(Device::Cpu).contiguous();
        let numel = t.numel();
        let mut data = vec![0u8; numel * kind.elt_size_in_bytes()];
        t.f_copy_data_u8(&mut data, numel)
            .map_err(|e| bad(e.to_string()))?;
        let shape = t.size().iter().map(|d| *d as usize).collect();
        out.push(SnapshotTensor {
            name: full,
            dtype,
            shape,
            data,
        });
    }
    Ok(())
}

/// Saves `model` (and `optim`, the optimizer's state) for `step`, with `state` (JSON).
pub fn save(
    w: &mut Worker,
    step: u64,
    model: &VarStore,
    optim: Option<&VarStore>,
    state: Value,
) -> Result<std::path::PathBuf, WorkerError> {
    let mut tensors = Vec::new();
    snapshot("model", model, &mut tensors)?;
    if let Some(o) = optim {
        snapshot("optim", o, &mut tensors)?;
    }
    w.save_tensors(step, &tensors, state)
}

/// Loads the restored step into `model` (and `optim`): every variable must be in the
/// snapshot with its shape and kind. Returns `(step, state)`, or `None` for a fresh start.
pub fn load(
    w: &Worker,
    model: &mut VarStore,
    optim: Option<&mut VarStore>,
) -> Result<Option<(u64, Value)>, WorkerError> {
    let Some(loaded) = w.load_tensors()? else {
        return Ok(None);
    };
    let by_name: std::collections::HashMap<&str, &SnapshotTensor> = loaded
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    let fill = |prefix: &str, vs: &mut VarStore| -> Result<(), WorkerError> {
        for (name, mut var) in vs.variables() {
            let full = format!("{prefix}/{name}");
            let bad = |reason: String| WorkerError::Format {
                path: full.clone().into(),
                reason,
            };
            let t = by_name
                .get(full.as_str())
                .ok_or_else(|| bad("missing from the snapshot".into()))?;
            let kind = kind_of(t.dtype).ok_or_else(|| bad(format!("dtype {:?}", t.dtype)))?;
            let shape: Vec<i64> = t.shape.iter().map(|d| *d as i64).collect();
            if shape != var.size() || kind != var.kind() {
                return Err(bad(format!(
                    "snapshot has {:?} {:?}, the variable is {:?} {:?}",
                    kind,
                    shape,
                    var.kind(),
                    var.size()
                )));
            }
            let src =
                Tensor::f_from_data_size(&t.data, &shape, kind).map_err(|e| bad(e.to_string()))?;
            ::tch::no_grad(|| var.copy_(&src));
        }
        Ok(())
    };
    fill("model", model)?;
    if let Some(o) = optim {
        fill("optim", o)?;
    }
    Ok(Some((loaded.step, loaded.state)))
}
