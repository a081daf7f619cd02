//! The scaling flags (`--lr-scaling`, `--indivisible-batch`, `--batch-size`, `--global-batch`,
//! `--base-lr`, `--base-world-size`, `--warmup-steps`), parsed straight into the `elastic`
//! crate's types, and the job's [`ScalingConfig`] built from them.

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use elastic::ScalingConfig;
use elastic::scaling::{OnIndivisible, ScalingMode};

use super::Cli;

/// `--lr-scaling`: one of [`ScalingMode`]'s names, each with its help line (`--help` lists
/// them, and a bad value's error does too).
pub(super) fn lr_scaling_parser() -> impl TypedValueParser<Value = ScalingMode> {
    let help = |m: ScalingMode| match m {
        ScalingMode::Linear => "LR x W/W0",
        ScalingMode::Sqrt => "LR x sqrt(W/W0)",
        ScalingMode::None => "LR untouched",
        ScalingMode::Fixed => "Keep the global batch: grad accumulation changes, LR untouched",
    };
    PossibleValuesParser::new(
        ScalingMode::ALL.map(|m| PossibleValue::new(m.as_str()).help(help(m))),
    )
    .try_map(|s| s.parse::<ScalingMode>())
}

/// `--indivisible-batch`: one of [`OnIndivisible`]'s names.
pub(super) fn indivisible_batch_parser() -> impl TypedValueParser<Value = OnIndivisible> {
    PossibleValuesParser::new(OnIndivisible::ALL.map(|o| o.as_str()))
        .try_map(|s| s.parse::<OnIndivisible>())
}

impl Cli {
    /// The job's scaling configuration for `nproc` workers per node. The base world size
    /// defaults to `nproc` x the largest node count, and under `fixed` the global batch to
    /// batch x base world size. What the user did not give stays unknown (`None`);
    /// [`ScalingConfig::validate`] says when the policy needs it.
    pub fn scaling_config(&self, nproc: u32) -> ScalingConfig {
        let base_world_size = u64::from(
            self.base_world_size
                .unwrap_or(nproc.saturating_mul(self.nnodes.max)),
        );
        let global_batch = match self.lr_scaling {
            ScalingMode::Fixed => self
                .global_batch
                .or(self.batch_size.map(|b| b.saturating_mul(base_world_size))),
            _ => self.global_batch,
        };
        ScalingConfig {
            mode: self.lr_scaling,
            per_worker_batch: self.batch_size,
            base_world_size,
            base_lr: self.base_lr,
            global_batch,
            on_indivisible: self.indivisible_batch,
            warmup_steps: (self.warmup_steps > 0).then_some(self.warmup_steps),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;
    use crate::cli::try_parse as parse;

    /// Base world 4, batch 32, LR 0.1, 10 warm-up steps, and `extra`.
    fn cfg(mode: &str, extra: &[&str]) -> ScalingConfig {
        let mut args = vec![
            "--lr-scaling",
            mode,
            "--base-world-size",
            "4",
            "--batch-size",
            "32",
            "--base-lr",
            "0.1",
            "--warmup-steps",
            "10",
        ];
        args.extend_from_slice(extra);
        args.push("x.py");
        parse(&args).unwrap().scaling_config(1)
    }

    #[test]
    fn policies_scale_lr_and_accumulation_as_documented() {
        // (policy, world, lr_scale, per-worker batch, accum, global); `fixed` keeps the
        // default global batch, 32 x 4.
        let table = [
            ("linear", 8, 2.0, 32, 1, 256),
            ("linear", 2, 0.5, 32, 1, 64),
            ("sqrt", 16, 2.0, 32, 1, 512),
            ("sqrt", 1, 0.5, 32, 1, 32),
            ("none", 8, 1.0, 32, 1, 256),
            ("fixed", 2, 1.0, 32, 2, 128),
            ("fixed", 4, 1.0, 32, 1, 128),
            ("fixed", 1, 1.0, 32, 4, 128),
            // 128 over 3 workers has no exact split; the nearest global batch is 1 x 3 x 43 = 129.
            ("fixed", 3, 1.0, 1, 43, 129),
        ];
        for (policy, world, scale, batch, accum, global) in table {
            let s = cfg(policy, &[]).decide(world, Some(4)).unwrap();
            assert!(
                (s.lr_scale - scale).abs() < 1e-12,
                "{policy:?} {world}: {s:?}"
            );
            assert!((s.lr.unwrap() - 0.1 * scale).abs() < 1e-12);
            assert_eq!(s.per_worker_batch, Some(batch), "{policy:?} {world}");
            assert_eq!(s.grad_accum_steps, accum, "{policy:?} {world}");
            assert_eq!(s.global_batch, Some(global), "{policy:?} {world}");
        }
        assert_eq!(cfg("fixed", &[]).global_batch, Some(128));
        assert_eq!(cfg("linear", &[]).global_batch, None);
        assert_eq!(
            cfg("fixed", &["--global-batch", "96"]).global_batch,
            Some(96)
        );
    }

    #[test]
    fn warmup_applies_only_when_the_lr_changes() {
        let c = cfg("linear", &[]);
        assert_eq!(c.decide(8, Some(4)).unwrap().warmup_steps, 10);
        assert_eq!(c.decide(8, Some(8)).unwrap().warmup_steps, 0);
        let none = parse(&["--lr-scaling", "linear", "x.py"])
            .unwrap()
            .scaling_config(1);
        assert_eq!(none.warmup_steps, None, "--warmup-steps 0 is no warm-up");
    }

    #[test]
    fn fixed_refuses_an_indivisible_batch_when_asked_to() {
        let c = parse(&[
            "--lr-scaling",
            "fixed",
            "--indivisible-batch",
            "refuse",
            "--batch-size",
            "1",
            "--global-batch",
            "7",
            "--base-world-size",
            "4",
            "x.py",
        ])
        .unwrap()
        .scaling_config(1);
        assert_eq!(c.on_indivisible, OnIndivisible::Refuse);
        let e = c.decide(2, None).unwrap_err();
        assert!(matches!(e, elastic::Error::Indivisible { .. }), "{e:?}");
        assert!(e.to_string().contains('7'), "{e}");
    }

    #[test]
    fn fixed_without_batch_is_an_error() {
        let c = parse(&["--lr-scaling", "fixed", "x.py"])
            .unwrap()
            .scaling_config(2);
        let e = c.validate().unwrap_err();
        assert!(matches!(e, elastic::Error::FixedNeedsBatch), "{e:?}");
        assert_eq!(
            e.to_string(),
            "--lr-scaling fixed needs --batch-size (and optionally --global-batch)"
        );
        assert!(matches!(
            c.decide(2, None),
            Err(elastic::Error::FixedNeedsBatch)
        ));
        assert!(matches!(
            cfg("none", &[]).decide(0, None),
            Err(elastic::Error::InvalidScaling { .. })
        ));
    }

    #[test]
    fn unknown_batch_and_lr_stay_unknown() {
        let c = parse(&["--lr-scaling", "linear", "--base-world-size", "4", "x.py"])
            .unwrap()
            .scaling_config(1);
        assert_eq!((c.per_worker_batch, c.base_lr), (None, None));
        let s = c.decide(8, None).unwrap();
        assert_eq!(s.global_batch, None);
        assert_eq!(s.per_worker_batch, None);
        assert_eq!(s.lr, None);
        assert_eq!(s.lr_scale, 2.0);
    }

    #[test]
    fn defaults_and_base_world_size() {
        let cli = parse(&["--nnodes", "1:3", "x.py"]).unwrap();
        assert_eq!(cli.lr_scaling, ScalingMode::None);
        assert_eq!(cli.indivisible_batch, OnIndivisible::Nearest);
        let c = cli.scaling_config(2);
        assert_eq!(c.base_world_size, 6, "nproc x the largest node count");
        assert_eq!(c.mode, ScalingMode::None);
        let cli = parse(&["--indivisible-batch", "refuse", "x.py"]).unwrap();
        assert_eq!(cli.indivisible_batch, OnIndivisible::Refuse);
        for m in ScalingMode::ALL {
            let cli = parse(&["--lr-scaling", m.as_str(), "x.py"]).unwrap();
            assert_eq!(cli.lr_scaling, m);
        }
    }

    #[test]
    fn help_and_bad_values_list_the_choices() {
        let help = Cli::command().render_long_help().to_string();
        for line in [
            "- linear: LR x W/W0",
            "- sqrt:   LR x sqrt(W/W0)",
            "- none:   LR untouched",
            "- fixed:  Keep the global batch: grad accumulation changes, LR untouched",
            "[default: none]",
            "[default: nearest]",
            "[possible values: nearest, refuse]",
        ] {
            assert!(help.contains(line), "{line:?} missing from\n{help}");
        }
        let short = Cli::command().render_help().to_string();
        assert!(
            short.contains("[possible values: linear, sqrt, none, fixed]"),
            "{short}"
        );
        for (args, values) in [
            (
                ["--lr-scaling", "cubic", "x.py"],
                "[possible values: linear, sqrt, none, fixed]",
            ),
            (
                ["--indivisible-batch", "round", "x.py"],
                "[possible values: nearest, refuse]",
            ),
        ] {
            let err = parse(&args).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{err}");
            let msg = err.to_string();
            assert!(msg.contains(values) && msg.contains(args[1]), "{msg}");
        }
    }
}
