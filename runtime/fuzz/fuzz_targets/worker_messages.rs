//! A worker's request line on the agent socket, whatever its bytes, never panics the agent's
//! handler; a reply always comes, and a part is handed on only for `saved` or `skipped`.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use runtime::state::AgentState;
use worker::protocol::Reply;

fn state() -> &'static AgentState {
    static STATE: OnceLock<(tempfile_dir::Dir, AgentState)> = OnceLock::new();
    &STATE
        .get_or_init(|| {
            let dir = tempfile_dir::Dir::new();
            std::fs::create_dir_all(dir.0.join("step-5/rank-2")).unwrap();
            let state = AgentState::new(dir.0.clone());
            state.begin_group(3, 4, 2..4);
            (dir, state)
        })
        .1
}

/// A private staging root for the process, removed at exit.
mod tempfile_dir {
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Dir {
            let p = std::env::temp_dir().join(format!("worker-messages-fuzz-{}", std::process::id()));
            std::fs::create_dir_all(&p).unwrap();
            Dir(std::fs::canonicalize(p).unwrap())
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let (reply, part) = state().handle_line(data);
    if part.is_some() {
        assert!(matches!(reply, Reply::Ok), "a part handed on with {reply:?}");
    }
});
