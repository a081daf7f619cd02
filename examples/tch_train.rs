//! A Rust (tch) training worker under elastic-run: linear regression with SGD + momentum,
//! checkpointed through the Rust worker API (model and optimizer state as `VarStore`s).
//!
//!     cargo build --features tch --example tch_train
//!     elastic-run --standalone --nproc-per-node 1 --checkpoint-interval 20 --no-python \
//!         -- target/debug/examples/tch_train --steps 200
//!
//! Data is generated from --seed and indexed by the step, so a resumed run continues the same
//! stream; the final line prints a digest of the weights (`done step N weights HEX`).

use anyhow::{Context, Result};
use serde_json::json;
use tch::{Device, Kind, Tensor, nn, nn::Module};
use worker::Worker;

const FEATURES: i64 = 8;
const BATCH: i64 = 32;

fn arg(name: &str, default: u64) -> Result<u64> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .with_context(|| format!("{name} needs a value"))?
            .parse()
            .with_context(|| format!("{name} takes a number")),
        None => Ok(default),
    }
}

fn digest(vs: &nn::VarStore) -> String {
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    // FNV-1a over names and bytes: enough to compare runs bit for bit.
    let mut h: u64 = 0xcbf29ce484222325;
    for (name, t) in vars {
        let t = t.contiguous();
        let mut bytes = vec![0u8; t.numel() * 4];
        t.copy_data_u8(&mut bytes, t.numel());
        for b in name.bytes().chain(bytes) {
            h = (h ^ u64::from(b)).wrapping_mul(0x100000001b3);
        }
    }
    format!("{h:016x}")
}

fn main() -> Result<()> {
    let steps = arg("--steps", 100)?;
    let seed = arg("--seed", 0)? as i64;
    let sleep_ms = arg("--step-sleep-ms", 0)?;
    let base_lr = 0.05;
    let mut w = Worker::from_env()?;
    tch::manual_seed(seed);
    let mut model = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(model.root() / "fc", FEATURES, 1, Default::default());
    // The optimizer state: one momentum buffer per parameter, kept as variables.
    let mut optim = nn::VarStore::new(Device::Cpu);
    let mut bufs = Vec::new();
    let mut params: Vec<(String, Tensor)> = model.variables().into_iter().collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, p) in &params {
        let b = optim
            .root()
            .zeros_no_train(&name.replace('.', "_"), &p.size());
        bufs.push(b);
    }
    let true_w = Tensor::randn([FEATURES, 1], (Kind::Float, Device::Cpu));

    let mut step = 0u64;
    if let Some((s, state)) = worker_tch::load(&w, &mut model, Some(&mut optim))? {
        step = s;
        println!(
            "resumed from step {s} (saved at world {})",
            state["world_size"]
        );
    }
    while step < steps {
        step += 1;
        let lr = w.scaled_lr(base_lr);
        // The batch of this step, from a generator seeded by (seed, step).
        tch::manual_seed(seed * 1_000_003 + step as i64);
        let x = Tensor::randn([BATCH, FEATURES], (Kind::Float, Device::Cpu));
        let y = x.matmul(&true_w);
        let loss = (net.forward(&x) - y).square().mean(Kind::Float);
        for (_, p) in params.iter_mut() {
            p.zero_grad();
        }
        loss.backward();
        tch::no_grad(|| {
            for ((_, p), b) in params.iter().zip(bufs.iter_mut()) {
                let grad = p.grad();
                let _ = b.g_mul_scalar_(0.9).g_add_(&grad);
                let mut p = p.shallow_clone();
                let _ = p.g_sub_(&(b.shallow_clone() * lr));
            }
        });
        println!("step {step} loss {:.6} lr {lr}", loss.double_value(&[]));
        w.report_progress(step)?;
        let stop = w.should_stop(step)?;
        if stop || w.should_checkpoint(step) || step == steps {
            let state = json!({"world_size": w.world_size});
            worker_tch::save(&mut w, step, &model, Some(&optim), state)?;
            println!("saved step {step}");
        }
        if stop {
            println!("stopping at step {step} (drain)");
            break;
        }
        if sleep_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(sleep_ms));
        }
    }
    println!("done step {step} weights {}", digest(&model));
    Ok(())
}
