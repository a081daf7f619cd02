//! The runtime's integration tests, one binary: the agent end to end on one node
//! (`agent.rs`), several agents forming elastic jobs on a real etcd (`elastic.rs`), the
//! store sink against real stores (`store_sink.rs`), and the agent's decision core driven by
//! `testdata/agent_decide.json` and a seeded sweep (`agent_decide.rs`).

#[path = "suite/agent.rs"]
mod agent;
#[path = "suite/agent_decide.rs"]
mod agent_decide;
#[path = "suite/console.rs"]
mod console;
#[path = "suite/elastic.rs"]
mod elastic;
#[path = "suite/store_sink.rs"]
mod store_sink;
#[path = "suite/util.rs"]
mod util;
