//! `--checkpoint-store-option`: object_store options for the checkpoint store, checked by
//! name against the URL's backend. Values may be credentials: they are never printed.

use super::Cli;

impl Cli {
    /// Every `--checkpoint-store-option` (or `ELASTIC_CHECKPOINT_STORE_OPTIONS` entry), keys in
    /// lower case, in the order given.
    pub fn store_options(&self) -> Vec<(String, String)> {
        self.checkpoint_store_option
            .iter()
            .flat_map(|l| l.0.iter().cloned())
            .collect()
    }
}

/// One `--checkpoint-store-option` value: object_store configuration keys (lower case) and
/// their values. `Debug` shows the keys only: values may be credentials.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct StoreOptionList(pub Vec<(String, String)>);

impl std::fmt::Debug for StoreOptionList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| k))
            .finish()
    }
}

/// Largest number of options one `--checkpoint-store-option` value may hold.
const STORE_OPTIONS_MAX: usize = 64;

/// Whether object_store knows `key` (lower case) for the store of `scheme`; `None` for a
/// scheme whose store takes no options (`file`, `memory`).
pub fn store_option_known(scheme: &str, key: &str) -> Option<bool> {
    use std::str::FromStr;
    match scheme {
        "s3" | "s3a" => Some(object_store::aws::AmazonS3ConfigKey::from_str(key).is_ok()),
        "az" | "azure" | "abfs" | "abfss" => {
            Some(object_store::azure::AzureConfigKey::from_str(key).is_ok())
        }
        "gs" => Some(object_store::gcp::GoogleConfigKey::from_str(key).is_ok()),
        _ => None,
    }
}

/// Checks `--checkpoint-store-option` against the store `url` opens: every key must be one of
/// that backend's, and `file://` and `memory://` stores take none. Names keys, never values.
pub fn check_store_options(url: &str, options: &[(String, String)]) -> Result<(), String> {
    let Some((k, _)) = options.first() else {
        return Ok(());
    };
    let scheme = url.split_once("://").map_or("file", |(s, _)| s);
    for (key, _) in options {
        match store_option_known(scheme, key) {
            Some(true) => {}
            Some(false) => {
                return Err(format!(
                    "`{key}` is not an option of {scheme}:// stores (object_store's {} names)",
                    match scheme {
                        "s3" | "s3a" => "AmazonS3ConfigKey",
                        "gs" => "GoogleConfigKey",
                        _ => "AzureConfigKey",
                    }
                ));
            }
            None => {
                return Err(format!(
                    "`{k}` given, but {scheme}:// stores take no options (they are for s3://, \
                     az:// and gs://)"
                ));
            }
        }
    }
    Ok(())
}

/// `KEY=VALUE[,KEY=VALUE...]`: a comma followed by something other than `KEY=` belongs to the
/// value before it. Each key must be an object_store option of some backend (S3, Azure, GCS);
/// the URL's own backend is checked at start-up ([`check_store_options`]).
fn parse_store_options(s: &str) -> Result<StoreOptionList, String> {
    let key_like = |k: &str| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    };
    let mut out: Vec<(String, String)> = Vec::new();
    for part in s.split(',').filter(|p| !p.trim().is_empty()) {
        match part.split_once('=') {
            Some((k, v)) if key_like(k.trim()) => {
                out.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
            _ => match out.last_mut() {
                Some((_, v)) => {
                    v.push(',');
                    v.push_str(part.trim_end());
                }
                // Not echoed: it may be a credential given without its key.
                None => return Err("expected KEY=VALUE (object_store option names)".into()),
            },
        }
        if out.len() > STORE_OPTIONS_MAX {
            return Err(format!("more than {STORE_OPTIONS_MAX} options"));
        }
    }
    for (k, _) in &out {
        let known = ["s3", "az", "gs"]
            .iter()
            .any(|scheme| store_option_known(scheme, k) == Some(true));
        if !known {
            return Err(format!(
                "unknown store option `{k}`: use object_store's names for S3 (`aws_endpoint`, \
                 `aws_region`, ...), Azure (`azure_storage_account_name`, ...) or GCS \
                 (`google_service_account`, ...), or a client option (`timeout`, \
                 `connect_timeout`, `allow_http`, ...)"
            ));
        }
    }
    Ok(StoreOptionList(out))
}

/// clap's parser for `--checkpoint-store-option`: `parse_store_options`, with errors that do
/// not echo the value given (clap's own would), since values may be credentials.
#[derive(Clone, Copy, Debug)]
pub struct StoreOptionsParser;

impl clap::builder::TypedValueParser for StoreOptionsParser {
    type Value = StoreOptionList;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<StoreOptionList, clap::Error> {
        let fail = |kind, why: String| {
            clap::Error::raw(kind, format!("--checkpoint-store-option: {why}\n")).with_cmd(cmd)
        };
        let s = value
            .to_str()
            .ok_or_else(|| fail(clap::error::ErrorKind::InvalidUtf8, "not UTF-8".into()))?;
        parse_store_options(s).map_err(|e| fail(clap::error::ErrorKind::ValueValidation, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::try_parse as parse;

    #[test]
    fn checkpoint_store_options_parse_repeated_and_as_a_list_and_hide_their_values() {
        let cli = parse(&[
            "--checkpoint-url",
            "s3://b/job",
            "--checkpoint-store-option",
            "AWS_ENDPOINT=http://127.0.0.1:9000",
            "--checkpoint-store-option",
            "region=eu-west-1,aws_secret_access_key=s3cr3t,timeout=30s",
            "x.py",
        ])
        .unwrap();
        let opts = cli.store_options();
        assert_eq!(
            opts,
            [
                ("aws_endpoint", "http://127.0.0.1:9000"),
                ("region", "eu-west-1"),
                ("aws_secret_access_key", "s3cr3t"),
                ("timeout", "30s"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        let shown = format!("{cli:?}");
        assert!(shown.contains("aws_secret_access_key"), "{shown}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert_eq!(check_store_options("s3://b/job", &opts), Ok(()));
        // The environment's form: a comma before something that is not KEY= stays in the value.
        let l = parse_store_options("proxy_excludes=a.example,b.example, aws_region=x,").unwrap();
        assert_eq!(
            l.0,
            [
                ("proxy_excludes", "a.example,b.example"),
                ("aws_region", "x")
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        assert_eq!(parse_store_options("").unwrap().0, []);
        assert!(parse(&["x.py"]).unwrap().store_options().is_empty());
    }

    #[test]
    fn bad_checkpoint_store_options_are_refused_by_name() {
        let err = parse(&["--checkpoint-store-option", "aws_regoin=x", "x.py"]).unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains("`aws_regoin`"), "{err}");
        let err = parse(&["--checkpoint-store-option", "hunter2", "x.py"]).unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert!(!err.to_string().contains("hunter2"), "{err}");
        // Known to some backend, but not to the URL's.
        let az = [("azure_storage_account_name".to_string(), "acct".to_string())];
        let e = check_store_options("s3://b/job", &az).unwrap_err();
        assert!(
            e.contains("`azure_storage_account_name`") && e.contains("s3://"),
            "{e}"
        );
        assert_eq!(check_store_options("az://c/job", &az), Ok(()));
        let gs = [("google_service_account".to_string(), "/k.json".to_string())];
        assert_eq!(check_store_options("gs://b/job", &gs), Ok(()));
        let e = check_store_options("file:///tmp/ck", &gs).unwrap_err();
        assert!(
            e.contains("take no options") && !e.contains("/k.json"),
            "{e}"
        );
        assert_eq!(check_store_options("file:///tmp/ck", &[]), Ok(()));
    }
}
