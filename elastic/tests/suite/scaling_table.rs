//! Table tests for the scaling policy.

use elastic::Error;
use elastic::scaling::{OnIndivisible, ScalingConfig, ScalingDecision, ScalingMode};

fn cfg(
    mode: ScalingMode,
    b: u64,
    w0: u64,
    global: Option<u64>,
    on: OnIndivisible,
) -> ScalingConfig {
    ScalingConfig {
        mode,
        per_worker_batch: Some(b),
        base_world_size: w0,
        base_lr: Some(0.1),
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
        let (Some(global_batch), Some(per_worker_batch), Some(lr)) =
            (d.global_batch, d.per_worker_batch, d.lr)
        else {
            panic!(
                "{}: a known batch and LR give known values: {d:?}",
                row.name
            );
        };
        let got = (
            d.lr_scale,
            global_batch,
            d.grad_accum_steps,
            per_worker_batch,
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
            global_batch,
            per_worker_batch * row.world * d.grad_accum_steps,
            "{}",
            row.name
        );
        assert!((lr - 0.1 * d.lr_scale).abs() < 1e-12, "{}", row.name);
        assert!(
            per_worker_batch >= 1 && Some(per_worker_batch) <= row.cfg.per_worker_batch,
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
    nan.base_lr = Some(f64::NAN);
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

/// The runtime's table: base world 4, batch 32, LR 0.1, a global batch of 32 x 4 for `fixed`,
/// the previous world at the base size.
#[test]
fn policies_scale_lr_and_accumulation_as_documented() {
    use ScalingMode::{Fixed, Linear, Sqrt};
    // (mode, world, lr_scale, per-worker batch, accum, global)
    let table = [
        (Linear, 8, 2.0, 32, 1, 256),
        (Linear, 2, 0.5, 32, 1, 64),
        (Sqrt, 16, 2.0, 32, 1, 512),
        (Sqrt, 1, 0.5, 32, 1, 32),
        (ScalingMode::None, 8, 1.0, 32, 1, 256),
        (Fixed, 2, 1.0, 32, 2, 128),
        (Fixed, 4, 1.0, 32, 1, 128),
        (Fixed, 1, 1.0, 32, 4, 128),
        // 128 over 3 workers has no exact split; the nearest global batch is 1 x 3 x 43 = 129.
        (Fixed, 3, 1.0, 1, 43, 129),
    ];
    for (mode, world, scale, batch, accum, global) in table {
        let mut c = cfg(mode, 32, 4, Some(128), OnIndivisible::Nearest);
        c.warmup_steps = Some(10);
        let d = c.decide(world, Some(4)).unwrap();
        assert!((d.lr_scale - scale).abs() < 1e-12, "{mode} {world}: {d:?}");
        assert!(
            (d.lr.unwrap() - 0.1 * scale).abs() < 1e-12,
            "{mode} {world}"
        );
        assert_eq!(d.per_worker_batch, Some(batch), "{mode} {world}");
        assert_eq!(d.grad_accum_steps, accum, "{mode} {world}");
        assert_eq!(d.global_batch, Some(global), "{mode} {world}");
    }
}

#[test]
fn unknown_batch_and_lr_stay_unknown_and_out_of_the_env() {
    let mut c = cfg(ScalingMode::Linear, 32, 4, None, OnIndivisible::Nearest);
    c.per_worker_batch = None;
    c.base_lr = None;
    c.warmup_steps = Some(10);
    let d = c.decide(8, None).unwrap();
    assert_eq!(d.global_batch, None);
    assert_eq!(d.per_worker_batch, None);
    assert_eq!(d.lr, None);
    assert_eq!(d.lr_scale, 2.0);
    assert_eq!(d.grad_accum_steps, 1);
    assert_eq!(d.warmup_steps, 10);
    let env: std::collections::BTreeMap<_, _> = d.env().into_iter().collect();
    assert_eq!(
        env,
        [
            ("ELASTIC_GRAD_ACCUM_STEPS", "1"),
            ("ELASTIC_LR_SCALE", "2"),
            ("ELASTIC_WARMUP_STEPS", "10"),
        ]
        .map(|(k, v)| (k, v.to_string()))
        .into()
    );
    // A known batch with an unknown LR: only the LR is left out.
    c.per_worker_batch = Some(32);
    let d = c.decide(8, None).unwrap();
    assert_eq!(
        (d.per_worker_batch, d.global_batch, d.lr),
        (Some(32), Some(256), None)
    );
    let names: Vec<_> = d.env().into_iter().map(|(k, _)| k).collect();
    assert!(!names.contains(&"ELASTIC_LR"), "{names:?}");
    assert_eq!(names.len(), 5, "{names:?}");
    assert_eq!(
        ScalingDecision::identity().env(),
        [
            ("ELASTIC_LR_SCALE", "1".to_string()),
            ("ELASTIC_GRAD_ACCUM_STEPS", "1".to_string()),
            ("ELASTIC_WARMUP_STEPS", "0".to_string()),
        ]
    );
}

#[test]
fn fixed_without_a_batch_is_a_typed_error_naming_the_flag() {
    for global in [None, Some(128)] {
        let mut c = cfg(ScalingMode::Fixed, 32, 4, global, OnIndivisible::Nearest);
        c.per_worker_batch = None;
        let e = c.validate().unwrap_err();
        assert!(matches!(e, Error::FixedNeedsBatch), "{e:?}");
        assert!(e.to_string().contains("--batch-size"), "{e}");
        assert!(matches!(c.decide(4, None), Err(Error::FixedNeedsBatch)));
    }
    // Without `fixed`, an unknown batch is fine.
    let mut c = cfg(ScalingMode::Sqrt, 32, 4, None, OnIndivisible::Nearest);
    c.per_worker_batch = None;
    assert!(c.decide(4, None).is_ok());
}

#[test]
fn modes_read_and_write_their_names() {
    for m in ScalingMode::ALL {
        assert_eq!(m.to_string().parse::<ScalingMode>().unwrap(), m);
        // The same spelling as in the records.
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            format!("\"{m}\""),
            "{m:?}"
        );
    }
    assert_eq!(ScalingMode::None.to_string(), "none");
    for o in OnIndivisible::ALL {
        assert_eq!(o.to_string().parse::<OnIndivisible>().unwrap(), o);
        assert_eq!(serde_json::to_string(&o).unwrap(), format!("\"{o}\""));
    }
    assert_eq!(
        "refuse".parse::<OnIndivisible>().unwrap(),
        OnIndivisible::Refuse
    );
    let e = "round".parse::<OnIndivisible>().unwrap_err();
    assert!(e.to_string().contains("nearest, refuse"), "{e}");
    assert!("Linear".parse::<ScalingMode>().is_err());
}

#[test]
fn unknown_values_travel_as_null_and_old_records_with_numbers_still_parse() {
    let mut c = cfg(ScalingMode::Linear, 32, 4, None, OnIndivisible::Nearest);
    c.per_worker_batch = None;
    c.base_lr = None;
    let d = c.decide(8, None).unwrap();
    let json: serde_json::Value = serde_json::to_value(&d).unwrap();
    for k in ["lr", "global_batch", "per_worker_batch"] {
        assert!(json[k].is_null(), "{k}: {json}");
        assert!(
            json.as_object().unwrap().contains_key(k),
            "{k} is written: {json}"
        );
    }
    let back: ScalingDecision = serde_json::from_value(json).unwrap();
    assert_eq!(back, d);
    // A record written before the values could be unknown: numbers everywhere.
    let old = r#"{"lr_scale":1.5,"lr":0.15,"global_batch":192,"grad_accum_steps":1,
                  "per_worker_batch":32,"warmup_steps":100,"note":""}"#;
    let d: ScalingDecision = serde_json::from_str(old).unwrap();
    assert_eq!(
        d,
        ScalingDecision {
            lr_scale: 1.5,
            lr: Some(0.15),
            global_batch: Some(192),
            grad_accum_steps: 1,
            per_worker_batch: Some(32),
            warmup_steps: 100,
            note: String::new(),
        }
    );
    // And the configuration, which the records of older builds also held as numbers.
    let old_cfg = r#"{"mode":"fixed","per_worker_batch":32,"base_world_size":4,"base_lr":0.1,
                      "global_batch":128,"on_indivisible":"refuse","warmup_steps":null}"#;
    let c: ScalingConfig = serde_json::from_str(old_cfg).unwrap();
    assert_eq!(
        (c.per_worker_batch, c.base_lr, c.on_indivisible),
        (Some(32), Some(0.1), OnIndivisible::Refuse)
    );
}
