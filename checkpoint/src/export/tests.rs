//! Unit tests of the export's plan: sizes, shard splits, name order and layouts.

use super::*;
use crate::format::{FileEntry, ShardEntry, TensorEntry};

#[test]
fn sizes_take_hugging_face_spellings() {
    for (s, want) in [
        ("5GB", 5_000_000_000u64),
        ("500MB", 500_000_000),
        ("2GiB", 2 << 30),
        ("100KB", 100_000),
        ("100kb", 100_000 / 8),
        ("3mib", 3 << 20),
        ("1000", 1000),
        ("1", 1),
    ] {
        assert_eq!(parse_size_bytes(s), Ok(want), "{s}");
    }
    for s in [
        "0", "0GB", "", "GB", "5 GB", "-1", "1.5GB", "5TB", "abc", "1b",
    ] {
        assert!(parse_size_bytes(s).is_err(), "{s:?} accepted");
    }
    let e = parse_size_bytes("99999999999999999999GB").unwrap_err();
    assert!(e.contains("too large") || e.contains("not a size"), "{e}");
}

#[test]
fn shards_split_greedily_with_oversized_tensors_alone() {
    assert_eq!(split_shards(&[4, 4, 4], 10), vec![vec![0, 1], vec![2]]);
    assert_eq!(split_shards(&[4, 6, 1], 10), vec![vec![0, 1], vec![2]]);
    // The large tensor gets its own file at once, before the one being filled.
    assert_eq!(
        split_shards(&[3, 25, 3, 5], 10),
        vec![vec![1], vec![0, 2], vec![3]]
    );
    assert_eq!(split_shards(&[1, 2, 3], 100), vec![vec![0, 1, 2]]);
    assert_eq!(split_shards(&[0, 0], 1), vec![vec![0, 1]]);
    assert!(split_shards(&[], 1).is_empty());
}

#[test]
fn natural_order_puts_layer_2_before_layer_10() {
    let mut names = vec![
        "layers.10.weight",
        "layers.2.weight",
        "layers.2.bias",
        "embed",
        "layers.02.bias",
        "head",
    ];
    names.sort_by(|a, b| natural_cmp(a, b));
    assert_eq!(
        names,
        [
            "embed",
            "head",
            "layers.02.bias",
            "layers.2.bias",
            "layers.2.weight",
            "layers.10.weight"
        ]
    );
}

/// A manifest holding one F32 tensor of 4 bytes per name, with `metadata`.
fn manifest(names: &[&str], metadata: Value) -> Manifest {
    let tensors = names
        .iter()
        .map(|n| TensorEntry {
            name: n.to_string(),
            dtype: "F32".into(),
            shape: vec![1],
            sharded: false,
            shards: vec![ShardEntry {
                dim0_offset: 0,
                shape: vec![1],
                file: 0,
                data_offsets: [0, 4],
            }],
        })
        .collect();
    Manifest {
        format_version: 1,
        step: 7,
        created_unix_ms: 0,
        world_size: 1,
        metadata,
        parts: vec![],
        objects: vec![],
        files: vec![FileEntry {
            name: "f".into(),
            header: String::new(),
            data_bytes: 0,
            segments: vec![],
        }],
        tensors,
    }
}

fn skeleton(entries: Value) -> Value {
    serde_json::json!({"elastic": {}, "state": {"format": STATE_FORMAT, "entries": entries}})
}

#[test]
fn a_module_entry_exports_under_its_state_dict_names() {
    let m = manifest(
        &[
            "state/model/layers.10.w",
            "state/model/layers.9.w",
            "state/model/a%2Fb",
        ],
        skeleton(serde_json::json!({"model": {"stateful": true, "value": {
            "layers.10.w": {"$t": "state/model/layers.10.w"},
            "layers.9.w": {"$t": "state/model/layers.9.w"},
            "a/b": {"$t": "state/model/a%2Fb"},
        }}})),
    );
    let names: Vec<String> = module_tensors(&m, "model")
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, ["a/b", "layers.9.w", "layers.10.w"]);
    // A plain dict of tensors with a "$" key, as the client wraps it.
    let m = manifest(
        &["state/ema/%24x"],
        skeleton(
            serde_json::json!({"ema": {"stateful": false, "value": {"$dict": {
            "$x": {"$t": "state/ema/%24x"}}}}}),
        ),
    );
    assert_eq!(module_tensors(&m, "ema").unwrap()[0].name, "$x");
}

#[test]
fn entries_that_are_not_flat_maps_of_tensors_are_refused_naming_the_place() {
    let m = manifest(
        &["state/optim/state/~0/exp_avg", "state/model/w", "state/x/0"],
        skeleton(serde_json::json!({
            "optim": {"stateful": true, "value": {
                "state": {"$items": [[0, {"exp_avg": {"$t": "state/optim/state/~0/exp_avg"}}]]},
                "param_groups": [{"lr": 0.1}]}},
            "model": {"stateful": true, "value": {"w": {"$t": "state/model/w"}, "v": {"$t": "state/model/gone"}}},
            "x": {"stateful": false, "value": [{"$t": "state/x/0"}]},
            "t": {"stateful": false, "value": {"$t": "state/model/w"}},
            "n": {"stateful": false, "value": {"a": {"$nd": "state/model/w"}}},
            "e": {"stateful": false, "value": {}},
            "bad": {"value": {}},
        })),
    );
    for (key, want) in [
        (
            "optim",
            "state[\"optim\"][\"param_groups\"] holds a list, not a tensor: only a module-like entry",
        ),
        (
            "model",
            "state[\"model\"][\"v\"] refers to the tensor \"state/model/gone\"",
        ),
        ("x", "state[\"x\"] holds a list"),
        ("t", "state[\"t\"] holds a \"$t\" value"),
        ("n", "state[\"n\"][\"a\"] holds a \"$nd\" value"),
        ("e", "holds no tensors"),
        ("bad", "not {\"stateful\": bool"),
        (
            "nope",
            "no entry \"nope\"; its entries are \"bad\", \"e\", \"model\", \"n\", \"optim\", \"t\", \"x\"",
        ),
    ] {
        let e = module_tensors(&m, key).unwrap_err();
        assert!(e.contains(want), "{key}: {e}");
    }
    let mut m = m;
    m.metadata["state"]["format"] = "other/1".into();
    let e = module_tensors(&m, "model").unwrap_err();
    assert!(e.contains("metadata.state.format"), "{e}");
}

#[test]
fn a_legacy_checkpoint_exports_its_model_tensors() {
    let m = manifest(
        &[
            "model/0.weight",
            "model/0.bias",
            "optim/state/0/exp_avg",
            "extra/k",
        ],
        serde_json::json!({"elastic": {}, "state": {"optim_state": {}}}),
    );
    let names: Vec<String> = module_tensors(&m, "model")
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, ["0.bias", "0.weight"]);
    let e = module_tensors(&m, "optim").unwrap_err();
    assert!(e.contains("only a module-like entry exports"), "{e}");
    let e = module_tensors(&m, "ema").unwrap_err();
    assert!(e.contains("\"extra\", \"model\", \"optim\""), "{e}");
}

#[test]
fn a_plan_over_the_shard_size_names_files_as_hugging_face_does() {
    let m = manifest(&["model/a", "model/b", "model/c"], serde_json::json!({}));
    let p = plan(&m, "model", 8).unwrap();
    let names: Vec<&str> = p.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
    assert_eq!(p.total_bytes, 12);
    assert_eq!(plan(&m, "model", 12).unwrap().files[0].name, SINGLE_FILE);
}
