//! `elastic-run`: see the `runtime` crate docs.

use std::process::ExitCode;

use clap::Parser;
use runtime::agent::{self, UsageError};
use runtime::cli::Cli;

fn main() -> ExitCode {
    checkpoint::alloc::release_freed_buffers_eagerly();
    // `elastic-run status ...` reads a job's state; anything else runs an agent.
    if std::env::args_os().nth(1).is_some_and(|a| a == "status") {
        let cli = runtime::status::StatusCli::parse_from(std::env::args_os().skip(1));
        runtime::logging::init(false);
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("elastic-run: error: cannot start the async runtime: {e}");
                return ExitCode::from(1);
            }
        };
        return ExitCode::from(rt.block_on(runtime::status::run(cli)));
    }
    // Usage errors exit 2 with clap's message.
    let cli = Cli::parse();
    runtime::logging::init(cli.json);
    // A current-thread runtime on the main thread: workers are forked from this thread, and
    // PR_SET_PDEATHSIG fires when the forking *thread* exits, so it must live as long as the
    // agent (tokio's blocking-pool threads do not).
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("elastic-run: error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(agent::run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) if e.downcast_ref::<UsageError>().is_some() => {
            eprintln!("elastic-run: error: {e:#}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("elastic-run: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
