//! Who is in the job: membership and rendezvous on etcd v3, and the scaling policy.
