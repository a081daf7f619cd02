//! Local cloud instance metadata services on loopback, for the preemption-notice tests. Each one
//! enforces what the real service enforces, so a client that works against it speaks the real
//! protocol:
//!
//! - [`Imds`] (AWS IMDS): a GET without a valid, unexpired IMDSv2 token answers 401 (as on
//!   instances that require IMDSv2, the default for new ones); `PUT /latest/api/token` needs the
//!   `X-aws-ec2-metadata-token-ttl-seconds` header (400 otherwise). [`Imds::start_v1`] serves an
//!   IMDS without the token endpoint (404 on the PUT), which answers tokenless GETs.
//! - [`Gce`] (GCP metadata server): a request without `Metadata-Flavor: Google` answers 403;
//!   `wait_for_change=true` hangs until the value changes (or `timeout_sec`), and `last_etag`
//!   returns at once when the value changed since that ETag.
//! - [`Azure`] (Azure IMDS scheduled events): a request without `Metadata: true` answers 400;
//!   the approval POST (`StartRequests`) is recorded with its EventIds and arrival time.
//!
//! Every server is a thread per connection behind one accept thread, bounded in connections,
//! request size and wait time; one request per connection (`Connection: close`). Dropping the
//! handle stops it and wakes any hanging request.
//!
//! # Layout
//!
//! - `server` (private): the tiny HTTP/1.1 server the three share.
//! - `imds`: [`Imds`], AWS.
//! - `gce`: [`Gce`], GCP.
//! - `azure`: [`Azure`], Azure.

mod azure;
mod gce;
mod imds;
mod server;

pub use azure::{AZURE_EVENTS_PATH, Azure, AzureApproval};
pub use gce::{GCE_PREEMPTED_PATH, GCE_WAIT_S_MAX, Gce};
pub use imds::{
    IMDS_INSTANCE_ACTION_PATH, IMDS_REBALANCE_PATH, IMDS_TOKEN_PATH, IMDS_TOKEN_TTL_S_MAX, Imds,
};
