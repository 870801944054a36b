//! `--set KEY=VALUE` on the command line: a key of the config set for one run without editing its
//! file (`--set pool.staging_blocks=32 --set dataset.dir=/data`). Each value is a TOML value (a
//! word that is not one is taken as a string), set at its dotted key before the config is parsed
//! and checked, so an unknown key or a wrong type is the error a file with it would give.

use super::{ConfigError, RunConfig};

impl RunConfig {
    /// [`RunConfig::load`], then `sets` applied in order.
    pub fn load_with(path: Option<&std::path::Path>, sets: &[String]) -> Result<Self, ConfigError> {
        if sets.is_empty() {
            return Self::load(path);
        }
        let (text, origin) = match path {
            None => (
                super::DEFAULT_CONFIG.to_string(),
                "<embedded default>".to_string(),
            ),
            Some(p) => {
                let bytes =
                    crate::formats::read_regular(p, super::MAX_CONFIG_BYTES).map_err(|source| {
                        ConfigError::Read {
                            path: p.to_path_buf(),
                            source,
                        }
                    })?;
                (
                    String::from_utf8_lossy(&bytes).into_owned(),
                    p.display().to_string(),
                )
            }
        };
        let parse = |e| ConfigError::Parse {
            origin: origin.clone(),
            source: Box::new(e),
        };
        let mut table: toml::Table = toml::from_str(&text).map_err(parse)?;
        for s in sets {
            set(&mut table, s).map_err(|reason| ConfigError::Invalid {
                origin: origin.clone(),
                key: "--set",
                reason,
            })?;
        }
        let text = toml::to_string(&table).map_err(|e| ConfigError::Invalid {
            origin: origin.clone(),
            key: "--set",
            reason: e.to_string(),
        })?;
        Self::from_toml(
            &text,
            &format!("{origin} with --set {}", sets.join(" --set ")),
        )
    }
}

/// Sets `KEY=VALUE` in `table`.
fn set(table: &mut toml::Table, s: &str) -> Result<(), String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected KEY=VALUE (pool.staging_blocks=32)"))?;
    let value = value.trim();
    let v = toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    let path: Vec<&str> = key.trim().split('.').collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(format!(
            "{key:?}: expected a dotted key (loader.batch_size)"
        ));
    }
    let (last, sections) = path
        .split_last()
        .ok_or_else(|| format!("{key:?}: no key"))?;
    let mut t = table;
    for p in sections {
        let entry = t
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = entry
            .as_table_mut()
            .ok_or_else(|| format!("{key:?}: {p} is a value, not a section"))?;
    }
    t.insert(last.to_string(), v);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_key_overrides_the_file_and_a_wrong_one_is_the_files_error() {
        let sets = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let c = RunConfig::load_with(
            None,
            &sets(&[
                "pool.staging_blocks=32",
                "loader.batch_size = 7",
                "dataset.dir=/data/x",
            ]),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.pool.staging_blocks, 32);
        assert_eq!(c.loader.batch_size, 7);
        assert_eq!(
            c.dataset.dir.as_deref(),
            Some(std::path::Path::new("/data/x"))
        );
        let e = RunConfig::load_with(None, &sets(&["loader.batch_sise=7"]))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("batch_sise"), "{e}");
        let e = RunConfig::load_with(None, &sets(&["loader.batch_size"]))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("KEY=VALUE"), "{e}");
    }
}
