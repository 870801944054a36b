//! Tests of the run configuration: the embedded default, units, errors, and the docs.

#![allow(clippy::unwrap_used)]

use super::*;

#[test]
fn embedded_default_equals_struct_defaults() {
    let mut parsed = RunConfig::from_toml(DEFAULT_CONFIG, "default").expect("default parses");
    // The one deliberate difference: the embedded default asks for its synthetic dataset; the
    // library default does not (a typo'd dataset.dir is an error, never synthetic data).
    assert!(
        parsed.dataset.generate,
        "configs/default.toml asks for generation"
    );
    assert!(!RunConfig::default().dataset.generate);
    parsed.dataset.generate = false;
    assert_eq!(
        parsed,
        RunConfig::default(),
        "configs/default.toml and the Default impls disagree"
    );
}

#[test]
fn sizes_parse_with_units() {
    assert_eq!(parse_size("4MiB"), Ok(4 << 20));
    assert_eq!(parse_size("256KiB"), Ok(256 << 10));
    assert_eq!(parse_size("512"), Ok(512));
    assert!(matches!(
        parse_size("4 parsecs"),
        Err(SizeError::Unit { .. })
    ));
    assert!(matches!(parse_size("x"), Err(SizeError::NotANumber(_))));
    assert_eq!(
        parse_size("99999999999TiB"),
        Err(SizeError::Overflow("99999999999TiB".into()))
    );
}

#[test]
fn unknown_keys_and_bad_values_are_clear_errors() {
    let e = RunConfig::from_toml("[engine]\nqueue_dept = 3\n", "t").unwrap_err();
    assert!(e.to_string().contains("queue_dept"), "{e}");
    // Enums are checked by serde: the error points at the line and lists what is allowed.
    let e = RunConfig::from_toml("[device]\nselect = \"tpu\"\n", "t").unwrap_err();
    assert!(e.to_string().contains("select = \"tpu\""), "{e}");
    assert!(e.to_string().contains("`auto`, `cuda`"), "{e}");
    let e = RunConfig::from_toml("[loader]\nmax_read = \"8MiB\"\n", "t").unwrap_err();
    assert!(e.to_string().contains("pool.staging_block_size"), "{e}");
    let e = RunConfig::from_toml("[dataset]\nformat = \"parquet\"\n", "t").unwrap_err();
    assert!(e.to_string().contains("format = \"parquet\""), "{e}");
    assert!(e.to_string().contains("`megatron`"), "{e}");
    let e = RunConfig::from_toml("[dataset]\ndtype = \"u17\"\n", "t").unwrap_err();
    assert!(e.to_string().contains("unknown dtype \"u17\""), "{e}");
    let e = RunConfig::from_toml("[loader]\nbatch_size = -1\n", "t").unwrap_err();
    assert!(e.to_string().contains("batch_size"), "{e}");
    let e = RunConfig::from_toml("[loader]\nrank = 3\nworld_size = 2\n", "t").unwrap_err();
    assert!(e.to_string().contains("loader.rank"), "{e}");
}

#[test]
fn json_errors_name_the_key_path() {
    let e = RunConfig::from_json(r#"{"dataset": {"format": "parquet"}}"#, "t").unwrap_err();
    assert!(e.to_string().contains("dataset.format"), "{e}");
    let e = RunConfig::from_json(r#"{"engine": {"queue_dept": 3}}"#, "t").unwrap_err();
    assert!(e.to_string().contains("queue_dept"), "{e}");
    let c = RunConfig::from_json(r#"{"engine": {"io": "auto"}}"#, "t").unwrap();
    assert_eq!(c.engine.io, IoMode::Auto);
}

#[test]
fn docs_list_every_key_with_its_default() {
    let doc = include_str!("../../../docs/configuration.md");
    // Every key of the struct, with its default as written in the docs' table.
    let d = RunConfig::default();
    let v = toml::Value::try_from(&d).expect("serializable");
    let mut rows = Vec::new();
    if let toml::Value::Table(sections) = v {
        for (sec, t) in sections {
            if let toml::Value::Table(t) = t {
                for (k, val) in t {
                    rows.push((format!("{sec}.{k}"), val.to_string()));
                }
            }
        }
    }
    // Keys whose default is "unset" do not serialize.
    for key in [
        "device.ordinal",
        "loader.rank",
        "loader.world_size",
        "pool.numa_node",
        "metrics.listen",
        "cache.dir",
    ] {
        rows.push((key.to_string(), "unset".to_string()));
    }
    assert!(rows.len() >= 38, "only {} keys found", rows.len());
    for (key, default) in rows {
        let row = format!("| `{key}` | `{default}` |");
        assert!(
            doc.contains(&row),
            "docs/configuration.md lacks the row {row}"
        );
    }
}
