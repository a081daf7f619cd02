//! The run report: JSON, and an SVG timeline with membership, world size, LR, step progress,
//! checkpoints and faults on one time axis.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::events::{Event, Record, first_steps, generations};
use crate::invariants::{Check, FaultEffect, Fired, Outcome};

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub scenario: String,
    pub seed: u64,
    pub job: String,
    pub wall_ms: u64,
    pub faults: Vec<FaultEffect>,
    /// The first record of each generation.
    pub generations: Vec<Record>,
    pub checks: Vec<Check>,
    pub outcome: Outcome,
    pub passed: bool,
}

const W: f64 = 1000.0;
const LEFT: f64 = 110.0;
const RIGHT: f64 = 20.0;
const LANE_H: f64 = 18.0;
const PANEL_H: f64 = 70.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The timeline as SVG text. `end_unix_ms`: when the run ended (the axis reaches it even when
/// the agents fell silent before, as a hung job does).
pub fn timeline_svg(
    title: &str,
    events: &[Record],
    fired: &[Fired],
    end_unix_ms: Option<u64>,
) -> String {
    let ts = |e: &Record| e.ts_ms;
    let t0 = events.iter().map(ts).min().unwrap_or(0);
    let t1 = events
        .iter()
        .map(ts)
        .chain(fired.iter().map(|f| f.at_unix_ms + f.fault.duration_ms))
        .chain(end_unix_ms)
        .max()
        .unwrap_or(t0 + 1)
        .max(t0 + 1);
    let x = |t: u64| LEFT + (t.saturating_sub(t0)) as f64 / (t1 - t0) as f64 * (W - LEFT - RIGHT);
    let mut nodes: Vec<String> = Vec::new();
    for e in events {
        if !nodes.contains(&e.node) {
            nodes.push(e.node.clone());
        }
    }
    let lanes_top = 40.0;
    let panels_top = lanes_top + nodes.len() as f64 * LANE_H + 20.0;
    let height = panels_top + 3.0 * (PANEL_H + 20.0) + 40.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="10" y="20" font-size="14" font-weight="bold">{}</text>"#,
        esc(title)
    );
    let colors = [
        "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f",
    ];

    // Membership: per node, a bar per generation it ran in, until its next event of another
    // generation or its exit.
    for (i, n) in nodes.iter().enumerate() {
        let y = lanes_top + i as f64 * LANE_H;
        let _ = writeln!(s, r#"<text x="10" y="{}">{}</text>"#, y + 12.0, esc(n));
        let mine: Vec<&Record> = events.iter().filter(|e| e.node == *n).collect();
        let starts: Vec<(u64, u64)> = mine
            .iter()
            .filter_map(|e| match e.event {
                Event::Generation { generation, .. } => Some((ts(e), generation)),
                _ => None,
            })
            .collect();
        let end = mine.iter().map(|e| ts(e)).max().unwrap_or(t1);
        for (k, (start, g)) in starts.iter().enumerate() {
            let stop = starts.get(k + 1).map_or(end, |n| n.0);
            let _ = writeln!(
                s,
                r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{}" fill="{}" opacity="0.8"><title>generation {g}</title></rect><text x="{:.1}" y="{:.1}" fill="white">g{g}</text>"#,
                x(*start),
                y + 2.0,
                (x(stop) - x(*start)).max(1.0),
                LANE_H - 4.0,
                colors[*g as usize % colors.len()],
                x(*start) + 2.0,
                y + 13.0
            );
        }
        for e in &mine {
            let (mark, color) = match e.event {
                Event::Exit { .. } => ("exit", "black"),
                Event::Fenced { .. } => ("fenced", "red"),
                Event::DrainStarted { .. } => ("drain", "purple"),
                Event::WorkerFailed { .. } => ("failed", "red"),
                _ => continue,
            };
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"><title>{mark}</title></circle>"#,
                x(ts(e)),
                y + LANE_H / 2.0
            );
        }
    }

    // Panels: world size, LR scale, steps (first steps and commits).
    let panel = |s: &mut String,
                 k: usize,
                 label: &str,
                 points: &[(u64, f64)],
                 stepwise: bool,
                 color: &str| {
        let top = panels_top + k as f64 * (PANEL_H + 20.0);
        let _ = writeln!(
            s,
            r#"<text x="10" y="{:.1}">{}</text>"#,
            top + PANEL_H / 2.0,
            esc(label)
        );
        let _ = writeln!(
            s,
            r##"<rect x="{LEFT}" y="{top:.1}" width="{:.1}" height="{PANEL_H}" fill="none" stroke="#ccc"/>"##,
            W - LEFT - RIGHT
        );
        if points.is_empty() {
            return;
        }
        let vmax = points
            .iter()
            .map(|p| p.1)
            .fold(f64::MIN, f64::max)
            .max(1e-9);
        let y = |v: f64| top + PANEL_H - v / vmax * (PANEL_H - 8.0);
        let mut d = String::new();
        for (i, (t, v)) in points.iter().enumerate() {
            if i == 0 {
                let _ = write!(d, "M{:.1},{:.1}", x(*t), y(*v));
            } else {
                if stepwise {
                    let _ = write!(d, " L{:.1},{:.1}", x(*t), y(points[i - 1].1));
                }
                let _ = write!(d, " L{:.1},{:.1}", x(*t), y(*v));
            }
        }
        if stepwise && let Some((_, v)) = points.last() {
            let _ = write!(d, " L{:.1},{:.1}", x(t1), y(*v));
        }
        let _ = writeln!(
            s,
            r#"<path d="{d}" fill="none" stroke="{color}" stroke-width="2"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="10" y="{:.1}" fill="{color}">max {vmax}</text>"#,
            top + PANEL_H / 2.0 + 14.0
        );
    };
    let mut world: BTreeMap<u64, (u64, f64, f64)> = BTreeMap::new();
    for g in generations(events) {
        // The LR itself where the agent reports it, else its scale.
        let lr = g.lr.unwrap_or(g.lr_scale);
        world
            .entry(g.generation)
            .or_insert((ts(g.record), f64::from(g.world_size), lr));
    }
    let wpts: Vec<(u64, f64)> = world.values().map(|(t, w, _)| (*t, *w)).collect();
    let lpts: Vec<(u64, f64)> = world.values().map(|(t, _, l)| (*t, *l)).collect();
    panel(&mut s, 0, "world size", &wpts, true, "#4e79a7");
    panel(&mut s, 1, "LR", &lpts, true, "#f28e2b");
    let mut spts: Vec<(u64, f64)> = events
        .iter()
        .filter_map(|e| match e.event {
            Event::FirstStep { step, .. } | Event::CheckpointCommitted { step, .. } => {
                Some((ts(e), step as f64))
            }
            _ => None,
        })
        .collect();
    spts.sort_by_key(|p| p.0);
    panel(&mut s, 2, "step (commits)", &spts, false, "#59a14f");
    let top = panels_top + 2.0 * (PANEL_H + 20.0);
    for (e, step) in events.iter().filter_map(|e| match e.event {
        Event::CheckpointCommitted {
            step,
            by_this_node: true,
            ..
        } => Some((e, step)),
        _ => None,
    }) {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" x2="{0:.1}" y1="{1:.1}" y2="{2:.1}" stroke="#59a14f"><title>commit step {3}</title></line>"##,
            x(ts(e)),
            top + PANEL_H,
            top + PANEL_H + 6.0,
            step
        );
    }
    // Faults across everything: a line when injected, a band while it lasts (partitions,
    // outages, hangs), grey when it could not be injected.
    for f in fired {
        let fx = x(f.at_unix_ms);
        let color = if f.skipped.is_some() { "#999" } else { "red" };
        if f.fault.duration_ms > 0 && f.skipped.is_none() {
            let end = x(f.at_unix_ms + f.fault.duration_ms);
            let _ = writeln!(
                s,
                r#"<rect x="{fx:.1}" y="30" width="{:.1}" height="{:.1}" fill="red" opacity="0.08"><title>{:?} on node{} for {} ms</title></rect>"#,
                (end - fx).max(1.0),
                height - 60.0,
                f.fault.kind,
                f.fault.node,
                f.fault.duration_ms
            );
        }
        let _ = writeln!(
            s,
            r#"<line x1="{fx:.1}" x2="{fx:.1}" y1="30" y2="{:.1}" stroke="{color}" stroke-dasharray="4,3"/><text x="{:.1}" y="{:.1}" fill="{color}" transform="rotate(-30 {fx:.1} {:.1})">{:?} n{}{}</text>"#,
            height - 30.0,
            fx + 2.0,
            height - 18.0,
            height - 18.0,
            f.fault.kind,
            f.fault.node,
            if f.skipped.is_some() {
                " (skipped)"
            } else {
                ""
            }
        );
    }
    // Time grid: a faint line every `tick_s`, at most about 12 of them.
    let span_s = (t1 - t0) as f64 / 1000.0;
    let tick_s = [1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0]
        .into_iter()
        .find(|t| span_s / t <= 12.0)
        .unwrap_or(1200.0);
    for k in 1..=(span_s / tick_s) as u64 {
        let tx = x(t0 + (k as f64 * tick_s * 1000.0) as u64);
        let _ = writeln!(
            s,
            r##"<line x1="{tx:.1}" x2="{tx:.1}" y1="{lanes_top}" y2="{:.1}" stroke="#000" opacity="0.07"/><text x="{tx:.1}" y="{:.1}" text-anchor="middle" fill="#666">{} s</text>"##,
            height - 30.0,
            height - 4.0,
            k as f64 * tick_s
        );
    }
    // Recovery points: the first step of each worker group, as a triangle on the step panel.
    let step_top = panels_top + 2.0 * (PANEL_H + 20.0);
    let step_max = spts.iter().map(|p| p.1).fold(1e-9, f64::max);
    for (e, generation, step) in first_steps(events) {
        let px = x(ts(e));
        let py = step_top + PANEL_H - step as f64 / step_max * (PANEL_H - 8.0);
        let _ = writeln!(
            s,
            r##"<path d="M{:.1},{:.1} l4,-7 l4,7 z" fill="#59a14f"><title>{} generation {} trains again from step {}</title></path>"##,
            px - 4.0,
            py,
            esc(&e.node),
            generation,
            step
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="{:.1}">0 s</text><text x="{:.1}" y="{:.1}" text-anchor="end">{:.1} s</text>"#,
        height - 4.0,
        W - RIGHT,
        height - 4.0,
        (t1 - t0) as f64 / 1000.0
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{Event, Record};
    use crate::scenario::{Fault, FaultKind};

    fn rec(ts_ms: u64, node: &str, event: Event) -> Record {
        Record {
            ts_ms,
            node: node.into(),
            event,
        }
    }

    fn generation(
        ts_ms: u64,
        node: &str,
        generation: u64,
        world_size: u32,
        lr_scale: f64,
    ) -> Record {
        rec(
            ts_ms,
            node,
            Event::Generation {
                generation,
                world_size,
                node_rank: 0,
                rank_offset: 0,
                members: vec![],
                lr_scale,
                lr: None,
                batch_size: None,
                global_batch: None,
                grad_accum_steps: 1,
                resume_step: None,
                restored_bytes: None,
                heal_step: None,
                prev_last_step: None,
                frozen_unix_ms: None,
                in_place: false,
            },
        )
    }

    #[test]
    fn timeline_shows_nodes_generations_commits_and_faults() {
        let events = vec![
            generation(1000, "n0", 1, 3, 1.0),
            generation(1000, "n1", 1, 3, 1.0),
            rec(
                2000,
                "n0",
                Event::FirstStep {
                    generation: 1,
                    step: 1,
                },
            ),
            rec(
                3000,
                "n0",
                Event::CheckpointCommitted {
                    step: 10,
                    generation: 1,
                    bytes: 100,
                    by_this_node: true,
                    store_ms: 0,
                },
            ),
            generation(5000, "n0", 2, 2, 0.66),
            rec(9000, "n0", Event::Exit { code: 0 }),
        ];
        let fired = vec![Fired {
            fault: Fault {
                at_ms: 0,
                kind: FaultKind::SigkillAgent,
                node: 1,
                duration_ms: 2000,
                delay_ms: 0,
            },
            at_unix_ms: 4000,
            skipped: None,
        }];
        let svg = timeline_svg("t <1>", &events, &fired, Some(8000));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        for needle in [
            "n0",
            "n1",
            "g1",
            "g2",
            "commit step 10",
            "SigkillAgent n1",
            "world size",
            "LR",
            "opacity=\"0.08\"",
            "t &lt;1&gt;",
            "8.0 s",
            ">4 s<",
            "n0 generation 1 trains again from step 1",
        ] {
            assert!(svg.contains(needle), "missing {needle}");
        }
    }
}
