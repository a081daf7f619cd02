//! torchrun's console flags: `--redirects` and `--tee` (which of a worker's streams go to its
//! log files, and which of those are also copied to the console), `--local-ranks-filter`
//! (whose output reaches the console at all) and `--log-dir`.

use std::collections::BTreeSet;

/// Largest number of per-rank entries in a `--redirects`/`--tee` map or `--local-ranks-filter`.
const RANK_ENTRIES_MAX: usize = 4096;

/// A set of a worker's standard streams, torchrun's `Std`: `0` none, `1` stdout, `2` stderr,
/// `3` both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Std(u8);

impl Std {
    pub const NONE: Std = Std(0);
    pub const OUT: Std = Std(1);
    pub const ERR: Std = Std(2);
    pub const ALL: Std = Std(3);

    pub fn has_out(self) -> bool {
        self.0 & 1 != 0
    }
    pub fn has_err(self) -> bool {
        self.0 & 2 != 0
    }
    pub fn union(self, other: Std) -> Std {
        Std(self.0 | other.0)
    }
    pub fn is_none(self) -> bool {
        self.0 == 0
    }

    fn parse(s: &str) -> Result<Std, String> {
        match s.trim() {
            "0" => Ok(Std::NONE),
            "1" => Ok(Std::OUT),
            "2" => Ok(Std::ERR),
            "3" => Ok(Std::ALL),
            other => Err(format!(
                "`{other}` is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"
            )),
        }
    }
}

/// `--redirects`/`--tee`: one [`Std`] for every local rank (`3`), or a map for some of them
/// (`0:1,1:2`; ranks not named get none), as torchrun reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StdSpec {
    #[default]
    None,
    All(Std),
    PerRank(Vec<(u32, Std)>),
}

impl StdSpec {
    /// The streams of `local_rank`.
    pub fn of(&self, local_rank: u32) -> Std {
        match self {
            StdSpec::None => Std::NONE,
            StdSpec::All(s) => *s,
            StdSpec::PerRank(m) => m
                .iter()
                .rev()
                .find(|(r, _)| *r == local_rank)
                .map_or(Std::NONE, |(_, s)| *s),
        }
    }

    /// Whether no rank gets any stream.
    pub fn is_none(&self) -> bool {
        match self {
            StdSpec::None => true,
            StdSpec::All(s) => s.is_none(),
            StdSpec::PerRank(m) => m.iter().all(|(_, s)| s.is_none()),
        }
    }
}

pub(super) fn parse_std_spec(s: &str) -> Result<StdSpec, String> {
    let t = s.trim();
    if !t.contains(':') {
        return Ok(match Std::parse(t)? {
            Std::NONE => StdSpec::None,
            std => StdSpec::All(std),
        });
    }
    let mut map = Vec::new();
    for part in t.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (rank, std) = part
            .split_once(':')
            .ok_or_else(|| format!("`{part}` is not LOCAL_RANK:STREAMS (as in `0:1,1:2`)"))?;
        let rank: u32 = rank
            .trim()
            .parse()
            .map_err(|_| format!("`{rank}` in `{part}` is not a local rank"))?;
        map.push((rank, Std::parse(std)?));
        if map.len() > RANK_ENTRIES_MAX {
            return Err(format!("more than {RANK_ENTRIES_MAX} entries"));
        }
    }
    Ok(StdSpec::PerRank(map))
}

/// `--local-ranks-filter`: the local ranks whose output reaches the console (`0` or `0,2`);
/// empty means every rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LocalRanks(pub BTreeSet<u32>);

impl LocalRanks {
    /// Whether `local_rank`'s output reaches the console.
    pub fn shows(&self, local_rank: u32) -> bool {
        self.0.is_empty() || self.0.contains(&local_rank)
    }
}

pub(super) fn parse_local_ranks(s: &str) -> Result<LocalRanks, String> {
    let mut set = BTreeSet::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let r: u32 = part
            .parse()
            .map_err(|_| format!("`{part}` is not a local rank (use a list such as `0,2`)"))?;
        set.insert(r);
        if set.len() > RANK_ENTRIES_MAX {
            return Err(format!("more than {RANK_ENTRIES_MAX} ranks"));
        }
    }
    Ok(LocalRanks(set))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn std_specs_read_as_torchrun_reads_them() {
        assert_eq!(parse_std_spec("0").unwrap(), StdSpec::None);
        assert_eq!(parse_std_spec("3").unwrap(), StdSpec::All(Std::ALL));
        let m = parse_std_spec("0:1,1:2").unwrap();
        assert_eq!(m.of(0), Std::OUT);
        assert_eq!(m.of(1), Std::ERR);
        assert_eq!(m.of(2), Std::NONE);
        assert!(!m.is_none());
        for bad in ["4", "x", "0:5", "a:1", "0:1,2", "-1:1"] {
            assert!(parse_std_spec(bad).is_err(), "{bad}");
        }
        assert!(Std::ALL.has_out() && Std::ALL.has_err());
        assert_eq!(Std::OUT.union(Std::ERR), Std::ALL);
    }

    #[test]
    fn local_ranks_filter_is_a_set_and_empty_shows_all() {
        let f = parse_local_ranks("0, 2").unwrap();
        assert!(f.shows(0) && f.shows(2) && !f.shows(1));
        assert!(parse_local_ranks("").unwrap().shows(7));
        assert!(parse_local_ranks("1,x").is_err());
    }
}
