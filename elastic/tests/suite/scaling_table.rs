//! Table tests for the scaling policy.

use elastic::Error;
use elastic::scaling::{OnIndivisible, ScalingConfig, ScalingMode};

fn cfg(
    mode: ScalingMode,
    b: u64,
    w0: u64,
    global: Option<u64>,
    on: OnIndivisible,
) -> ScalingConfig {
    ScalingConfig {
        mode,
        per_worker_batch: b,
        base_world_size: w0,
        base_lr: 0.1,
        global_batch: global,
        on_indivisible: on,
        warmup_steps: None,
    }
}

struct Row {
    name: &'static str,
    cfg: ScalingConfig,
    world: u64,
    /// (lr_scale, global_batch, accum, per_worker_batch, note is empty)
    expect: (f64, u64, u64, u64, bool),
}

#[test]
fn scaling_table() {
    use OnIndivisible::*;
    use ScalingMode::{Fixed, Linear, Sqrt};
    let rows = [
        Row {
            name: "linear_doubles",
            cfg: cfg(Linear, 32, 8, None, Nearest),
            world: 16,
            expect: (2.0, 512, 1, 32, true),
        },
        Row {
            name: "linear_halves",
            cfg: cfg(Linear, 32, 8, None, Nearest),
            world: 4,
            expect: (0.5, 128, 1, 32, true),
        },
        Row {
            name: "linear_at_base",
            cfg: cfg(Linear, 32, 8, None, Nearest),
            world: 8,
            expect: (1.0, 256, 1, 32, true),
        },
        Row {
            name: "sqrt_quadruple",
            cfg: cfg(Sqrt, 16, 4, None, Nearest),
            world: 16,
            expect: (2.0, 256, 1, 16, true),
        },
        Row {
            name: "sqrt_quarter",
            cfg: cfg(Sqrt, 16, 4, None, Nearest),
            world: 1,
            expect: (0.5, 16, 1, 16, true),
        },
        Row {
            name: "none_keeps_lr",
            cfg: cfg(ScalingMode::None, 16, 4, None, Nearest),
            world: 12,
            expect: (1.0, 192, 1, 16, true),
        },
        Row {
            name: "fixed_exact_accum",
            cfg: cfg(Fixed, 32, 8, Some(1024), Nearest),
            world: 8,
            expect: (1.0, 1024, 4, 32, true),
        },
        Row {
            name: "fixed_exact_after_shrink",
            cfg: cfg(Fixed, 32, 8, Some(1024), Nearest),
            world: 4,
            expect: (1.0, 1024, 8, 32, true),
        },
        Row {
            name: "fixed_exact_no_accum",
            cfg: cfg(Fixed, 32, 8, Some(1024), Nearest),
            world: 32,
            expect: (1.0, 1024, 1, 32, true),
        },
        // 1024 over 6 workers: no b' <= 32 splits it exactly (1024 is not a multiple of 3); the
        // nearest global batch is 1026 = 19 x 6 x 9 (largest b' among the closest).
        Row {
            name: "fixed_indivisible_nearest",
            cfg: cfg(Fixed, 32, 8, Some(1024), Nearest),
            world: 6,
            expect: (1.0, 1026, 9, 19, false),
        },
        Row {
            name: "fixed_exact_with_smaller_worker_batch",
            cfg: cfg(Fixed, 32, 8, Some(960), Nearest),
            world: 5,
            expect: (1.0, 960, 6, 32, true),
        },
        Row {
            name: "fixed_lowers_worker_batch_for_exact_split",
            cfg: cfg(Fixed, 32, 8, Some(1000), Nearest),
            world: 10,
            expect: (1.0, 1000, 4, 25, false),
        },
        Row {
            name: "fixed_global_smaller_than_world",
            cfg: cfg(Fixed, 4, 8, Some(3), Nearest),
            world: 8,
            expect: (1.0, 8, 1, 1, false),
        },
    ];
    let mut failures = Vec::new();
    for row in &rows {
        let d = row
            .cfg
            .decide(row.world, None)
            .unwrap_or_else(|e| panic!("{}: {e}", row.name));
        let got = (
            d.lr_scale,
            d.global_batch,
            d.grad_accum_steps,
            d.per_worker_batch,
            d.note.is_empty(),
        );
        if (got.0 - row.expect.0).abs() > 1e-9
            || got.1 != row.expect.1
            || got.2 != row.expect.2
            || got.3 != row.expect.3
            || got.4 != row.expect.4
        {
            failures.push(format!(
                "{}: expected {:?}, got {:?} ({})",
                row.name, row.expect, got, d.note
            ));
        }
        // Invariants that hold for every row.
        assert_eq!(
            d.global_batch,
            d.per_worker_batch * row.world * d.grad_accum_steps,
            "{}",
            row.name
        );
        assert!((d.lr - 0.1 * d.lr_scale).abs() < 1e-12, "{}", row.name);
        assert!(
            d.per_worker_batch >= 1 && d.per_worker_batch <= row.cfg.per_worker_batch,
            "{}",
            row.name
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn fixed_refuse_names_the_numbers() {
    let c = cfg(ScalingMode::Fixed, 32, 8, Some(1024), OnIndivisible::Refuse);
    match c.decide(6, None) {
        Err(Error::Indivisible {
            global_batch: 1024,
            per_worker_batch: 32,
            world_size: 6,
        }) => {}
        other => panic!("expected Indivisible, got {other:?}"),
    }
    // An exact split still passes under Refuse.
    assert_eq!(c.decide(16, None).unwrap().grad_accum_steps, 2);
}

#[test]
fn warmup_applies_only_when_the_lr_changes() {
    let mut c = cfg(ScalingMode::Linear, 32, 8, None, OnIndivisible::Nearest);
    c.warmup_steps = Some(100);
    assert_eq!(
        c.decide(8, None).unwrap().warmup_steps,
        0,
        "first generation at base size"
    );
    assert_eq!(
        c.decide(16, None).unwrap().warmup_steps,
        100,
        "first generation above base"
    );
    assert_eq!(c.decide(16, Some(8)).unwrap().warmup_steps, 100, "rescale");
    assert_eq!(c.decide(16, Some(16)).unwrap().warmup_steps, 0, "same size");
    let mut f = cfg(
        ScalingMode::Fixed,
        32,
        8,
        Some(1024),
        OnIndivisible::Nearest,
    );
    f.warmup_steps = Some(100);
    assert_eq!(
        f.decide(4, Some(8)).unwrap().warmup_steps,
        0,
        "fixed keeps the LR"
    );
}

#[test]
fn env_pairs_carry_every_field() {
    let d = cfg(
        ScalingMode::Fixed,
        32,
        8,
        Some(1024),
        OnIndivisible::Nearest,
    )
    .decide(4, None)
    .unwrap();
    let env: std::collections::BTreeMap<_, _> = d.env().into_iter().collect();
    assert_eq!(env["ELASTIC_LR_SCALE"], "1");
    assert_eq!(env["ELASTIC_LR"], "0.1");
    assert_eq!(env["ELASTIC_GLOBAL_BATCH"], "1024");
    assert_eq!(env["ELASTIC_GRAD_ACCUM_STEPS"], "8");
    assert_eq!(env["ELASTIC_BATCH_SIZE"], "32");
    assert_eq!(env["ELASTIC_WARMUP_STEPS"], "0");
    assert_eq!(env.len(), 6);
}

#[test]
fn bad_inputs_are_errors() {
    assert!(
        cfg(ScalingMode::Linear, 0, 8, None, OnIndivisible::Nearest)
            .decide(8, None)
            .is_err()
    );
    assert!(
        cfg(ScalingMode::Linear, 32, 0, None, OnIndivisible::Nearest)
            .decide(8, None)
            .is_err()
    );
    assert!(
        cfg(ScalingMode::Linear, 32, 8, None, OnIndivisible::Nearest)
            .decide(0, None)
            .is_err()
    );
    assert!(
        cfg(ScalingMode::Fixed, 32, 8, None, OnIndivisible::Nearest)
            .decide(8, None)
            .is_err()
    );
    let mut nan = cfg(ScalingMode::Linear, 32, 8, None, OnIndivisible::Nearest);
    nan.base_lr = f64::NAN;
    assert!(nan.decide(8, None).is_err());
    assert!("cubic".parse::<ScalingMode>().is_err());
    assert_eq!("sqrt".parse::<ScalingMode>().unwrap(), ScalingMode::Sqrt);
}

#[test]
fn decision_round_trips_through_json() {
    let d = cfg(ScalingMode::Sqrt, 16, 4, None, OnIndivisible::Nearest)
        .decide(9, Some(4))
        .unwrap();
    let back: elastic::ScalingDecision =
        serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
    assert_eq!(back, d);
}
