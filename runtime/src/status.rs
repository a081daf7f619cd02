//! `elastic-run status`: a job's members, generation, scaling decision and committed
//! checkpoints, read from etcd (and the checkpoint store) without joining the job.

use anyhow::Context;
use clap::Parser;
use serde_json::{Value, json};

/// `elastic-run status --rdzv-endpoint H:P --rdzv-id JOB [--rdzv-conf K=V,...]
/// [--checkpoint-url URL [--checkpoint-store-option K=V]...] [--json]`
#[derive(Debug, Clone, Parser)]
#[command(name = "elastic-run status", about = "Show an elastic-run job's state")]
pub struct StatusCli {
    /// etcd endpoints, `HOST:PORT[,HOST:PORT...]`.
    #[arg(
        long = "rdzv-endpoint",
        alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT"
    )]
    pub rdzv_endpoint: String,
    /// The job id (`--rdzv-id` of its agents).
    #[arg(long = "rdzv-id", alias = "rdzv_id", env = "PET_RDZV_ID")]
    pub rdzv_id: String,
    /// The agents' `--rdzv-conf`: its `protocol`, `cacert`, `cert`, `key` and
    /// `request_timeout_ms` say how to reach etcd, its other keys are accepted and not used.
    /// etcd's user and password come from `ELASTIC_ETCD_USERNAME` and `ELASTIC_ETCD_PASSWORD`,
    /// or `ETCDCTL_USER=user:password`, as for the agent.
    #[arg(long = "rdzv-conf", alias = "rdzv_conf", env = "PET_RDZV_CONF", default_value = "",
          value_parser = crate::cli::parse_rdzv_conf)]
    pub rdzv_conf: crate::cli::RdzvConf,
    /// Also list the committed steps in this checkpoint store.
    #[arg(long = "checkpoint-url", env = "ELASTIC_CHECKPOINT_URL")]
    pub checkpoint_url: Option<String>,
    /// The agents' `--checkpoint-store-option`s, for that store.
    #[arg(long = "checkpoint-store-option", env = "ELASTIC_CHECKPOINT_STORE_OPTIONS",
          value_name = "KEY=VALUE", hide_env_values = true,
          value_parser = crate::cli::StoreOptionsParser)]
    pub checkpoint_store_option: Vec<crate::cli::StoreOptionList>,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs `status`; returns the exit code (0; 1 when etcd or the store cannot be read; 2 for a
/// bad `--rdzv-conf` or store option).
pub async fn run(cli: StatusCli) -> u8 {
    match collect(&cli).await {
        Ok(v) => {
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                print!("{}", render(&v));
            }
            0
        }
        Err(e) => {
            eprintln!("elastic-run status: error: {e:#}");
            if e.downcast_ref::<crate::agent::UsageError>().is_some() {
                2
            } else {
                1
            }
        }
    }
}

async fn collect(cli: &StatusCli) -> anyhow::Result<Value> {
    for (k, _) in &cli.rdzv_conf.0 {
        if !crate::agent::RDZV_CONF_KEYS.contains(&k.as_str())
            && !crate::agent::RDZV_CONF_IGNORED_KEYS.contains(&k.as_str())
        {
            return Err(crate::agent::unknown_rdzv_conf_key(k));
        }
    }
    let connect = crate::agent::etcd_connect(&cli.rdzv_endpoint, &cli.rdzv_conf)?;
    let store_config: Vec<(String, String)> = cli
        .checkpoint_store_option
        .iter()
        .flat_map(|l| l.0.iter().cloned())
        .collect();
    if let Some(url) = &cli.checkpoint_url {
        crate::cli::check_store_options(url, &store_config)
            .map_err(|e| crate::agent::UsageError(format!("--checkpoint-store-option: {e}")))?;
    }
    let st = elastic::status(&connect, &cli.rdzv_id)
        .await
        .map_err(|e| crate::agent::explain_etcd_error(e, &connect, &cli.rdzv_id))
        .with_context(|| {
            format!(
                "read job {} at {}",
                cli.rdzv_id,
                connect.endpoints.join(",")
            )
        })?;
    let mut out = json!({
        "job": cli.rdzv_id,
        "leader": st.leader,
        "members": st.members.iter().map(|m| json!({
            "node_id": m.node_id, "addr": m.addr, "nproc": m.nproc,
            "joined_unix_ms": m.joined_unix_ms,
            "draining": st.draining.contains(&m.node_id),
        })).collect::<Vec<_>>(),
        "generation": st.generation,
        "latest_commit": st.latest_commit,
        "job_state": st.job_state,
        "waiting": st.waiting,
    });
    if let Some(url) = &cli.checkpoint_url {
        let store = checkpoint::Store::open_with_options(url, store_config)?;
        let cancel = checkpoint::CancellationToken::new();
        let steps = store.list_steps(&cancel).await?;
        out["checkpoints"] = json!({
            "url": store.url(),
            "steps": steps.iter().map(|s| json!({
                "step": s.step,
                "committed": s.committed,
                "world_size": s.manifest.as_ref().map(|m| m.world_size),
                "stored_bytes": s.manifest.as_ref().map(|m| m.stored_bytes),
                "created_unix_ms": s.manifest.as_ref().map(|m| m.created_unix_ms),
                "error": s.manifest_error,
            })).collect::<Vec<_>>(),
        });
    }
    Ok(out)
}

fn render(v: &Value) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "job        {}", v["job"].as_str().unwrap_or("?"));
    if let Some(st) = v["job_state"].as_object() {
        let _ = writeln!(
            s,
            "state      {} ({})",
            st.get("outcome").and_then(Value::as_str).unwrap_or("?"),
            st.get("reason").and_then(Value::as_str).unwrap_or("")
        );
    } else {
        let _ = writeln!(s, "state      running");
    }
    let _ = writeln!(s, "leader     {}", v["leader"].as_str().unwrap_or("-"));
    let members = v["members"].as_array().cloned().unwrap_or_default();
    let _ = writeln!(s, "members    {}", members.len());
    for m in &members {
        let _ = writeln!(
            s,
            "  {:<24} {:<22} nproc {}{}",
            m["node_id"].as_str().unwrap_or("?"),
            m["addr"].as_str().unwrap_or("?"),
            m["nproc"],
            if m["draining"].as_bool() == Some(true) {
                "  draining"
            } else {
                ""
            }
        );
    }
    match v["generation"].as_object() {
        Some(g) => {
            let _ = writeln!(
                s,
                "generation {} world {} master {}:{} resume step {}",
                g["number"],
                g["world_size"],
                g["master_addr"].as_str().unwrap_or("?"),
                g["master_port"],
                g.get("resume_step")
                    .filter(|x| !x.is_null())
                    .map_or("-".to_string(), |x| x.to_string())
            );
            let ids: Vec<&str> = g["members"]
                .as_array()
                .map(|a| a.iter().filter_map(|m| m["node_id"].as_str()).collect())
                .unwrap_or_default();
            let _ = writeln!(s, "  ranks    {}", ids.join(", "));
            let sc = &g["scaling"];
            let _ = writeln!(
                s,
                "  scaling  lr x{} (lr {}), batch {} x world x accum {} = global {}{}",
                sc["lr_scale"],
                sc["lr"],
                sc["per_worker_batch"],
                sc["grad_accum_steps"],
                sc["global_batch"],
                sc["note"]
                    .as_str()
                    .filter(|n| !n.is_empty())
                    .map(|n| format!(" ({n})"))
                    .unwrap_or_default()
            );
        }
        None => {
            let _ = writeln!(s, "generation none yet");
        }
    }
    if let Some(w) = v["waiting"].as_object() {
        let _ = writeln!(
            s,
            "waiting    below min: {}",
            w.get("reason").and_then(Value::as_str).unwrap_or("")
        );
    }
    match v["latest_commit"].as_object() {
        Some(c) => {
            let _ = match c.get("generation").and_then(Value::as_u64) {
                Some(g) => writeln!(
                    s,
                    "committed  step {} (by {}, generation {g})",
                    c["step"],
                    c["node_id"].as_str().unwrap_or("?")
                ),
                None => writeln!(
                    s,
                    "committed  step {} (by {})",
                    c["step"],
                    c["node_id"].as_str().unwrap_or("?")
                ),
            };
        }
        None => {
            let _ = writeln!(s, "committed  none recorded");
        }
    }
    if let Some(ck) = v["checkpoints"].as_object() {
        let _ = writeln!(s, "checkpoints in {}", ck["url"].as_str().unwrap_or("?"));
        for st in ck["steps"].as_array().cloned().unwrap_or_default() {
            let _ = writeln!(
                s,
                "  step {:<8} {:<10} world {:<4} {} bytes{}",
                st["step"],
                if st["committed"].as_bool() == Some(true) {
                    "committed"
                } else {
                    "partial"
                },
                st["world_size"],
                st["stored_bytes"],
                st["error"]
                    .as_str()
                    .map(|e| format!("  ({e})"))
                    .unwrap_or_default()
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_view_shows_generation_members_and_commits() {
        let v = json!({
            "job": "j", "leader": "a",
            "members": [{"node_id": "a", "addr": "h1", "nproc": 2, "draining": false},
                        {"node_id": "b", "addr": "h2", "nproc": 2, "draining": true}],
            "generation": {"number": 3, "world_size": 4, "master_addr": "h1", "master_port": 29500,
                           "resume_step": 40, "members": [{"node_id": "a"}, {"node_id": "b"}],
                           "scaling": {"lr_scale": 2.0, "lr": 0.2, "per_worker_batch": 32,
                                       "grad_accum_steps": 1, "global_batch": 128, "note": ""}},
            "latest_commit": {"step": 40, "node_id": "a"},
            "job_state": null, "waiting": null,
        });
        let s = render(&v);
        assert!(s.contains("generation 3 world 4"), "{s}");
        assert!(s.contains("ranks    a, b"), "{s}");
        assert!(s.contains("draining"), "{s}");
        assert!(s.contains("committed  step 40"), "{s}");
        assert!(s.contains("lr x2.0"), "{s}");
    }

    #[test]
    fn status_needs_endpoint_and_id() {
        assert!(StatusCli::try_parse_from(["status", "--rdzv-id", "j"]).is_err());
        let c = StatusCli::try_parse_from([
            "status",
            "--rdzv-endpoint",
            "h:1",
            "--rdzv-id",
            "j",
            "--json",
        ])
        .unwrap();
        assert!(c.json);
    }

    #[test]
    fn status_takes_the_agents_rdzv_conf_and_store_options() {
        let c = StatusCli::try_parse_from([
            "status",
            "--rdzv-endpoint",
            "h:1",
            "--rdzv-id",
            "j",
            "--rdzv-conf",
            "protocol=https,cacert=/ca.pem,lease_ttl_ms=2000",
            "--checkpoint-store-option",
            "aws_secret_access_key=s3cr3t",
        ])
        .unwrap();
        assert_eq!(c.rdzv_conf.get("cacert"), Some("/ca.pem"));
        assert!(!format!("{c:?}").contains("s3cr3t"));
        let bad = StatusCli::try_parse_from([
            "status",
            "--rdzv-endpoint",
            "h:1",
            "--rdzv-id",
            "j",
            "--checkpoint-store-option",
            "aws_secret_acess_key=s3cr3t",
        ])
        .unwrap_err();
        assert_eq!(bad.exit_code(), 2);
        assert!(!bad.to_string().contains("s3cr3t"), "{bad}");
    }
}
