//! The runtime's integration tests, one binary: the agent end to end on one node
//! (`agent.rs`), several agents forming elastic jobs on a real etcd (`elastic.rs`) or on the
//! etcd one of them serves (`c10d.rs`), the
//! store sink against real stores (`store_sink.rs`), and the agent's decision core driven by
//! `testdata/agent_decide.json` and a seeded sweep (`agent_decide.rs`), and torchrun's own
//! launcher test cases replayed through our command line (`torchrun.rs`).

#[path = "suite/agent.rs"]
mod agent;
#[path = "suite/agent_decide.rs"]
mod agent_decide;
#[path = "suite/c10d.rs"]
mod c10d;
#[path = "suite/console.rs"]
mod console;
#[path = "suite/elastic.rs"]
mod elastic;
#[path = "suite/store_sink.rs"]
mod store_sink;
#[path = "suite/torchrun.rs"]
mod torchrun;
#[path = "suite/util.rs"]
mod util;
