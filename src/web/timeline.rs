//! `GET /api/timeline/{node}`: when the agents of a subtree called their
//! model and their tools, and what they spent. One lane per agent (the
//! node's own and every agent below it, live or stopped, in start order);
//! on each lane a bar per model call (from its step's start, through its
//! first streamed chunk, to its message) and per tool call (from the call
//! to its result), each with its status; the workflow phases and Ralph
//! rounds its coordinators recorded, as bands; tokens per lane and in all
//! (input, output, cached; the cost where the route has a price).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use dsh_services::llm::LlmRuntime;
use dsh_services::persistence::{PERSISTENCE_SERVICE, SessionPersistence};
use dsh_supervisors::tree::NodeSnapshot;
use serde::Serialize;
use serde_json::{Value, json};

use super::{Api, error};

/// Most lanes one answer holds (`more` counts the rest).
const MAX_LANES: usize = 200;

/// One agent's lane.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Lane {
    /// The agent (its session id).
    pub agent: String,
    /// Its tree node.
    pub node: u64,
    /// Its label, when it has one.
    pub label: Option<String>,
    /// The node's depth below the selected one (0: the selection).
    pub depth: usize,
    /// Its first and last event, ms since epoch.
    pub start: u64,
    /// Its last event.
    pub end: u64,
    /// Model and tool calls, in the order they began.
    pub spans: Vec<Span>,
    /// What it spent.
    pub tokens: Tokens,
}

/// A model or tool call on a lane.
#[derive(Debug, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Span {
    /// `model` or `tool`.
    pub kind: &'static str,
    /// The tool's name, or `turn T step S`.
    pub name: String,
    /// Began, ms since epoch.
    pub start: u64,
    /// A model call's first streamed chunk.
    pub first_token: Option<u64>,
    /// Ended (the last event seen, while it runs).
    pub end: u64,
    /// `ok`, `failed` or `running`.
    pub status: &'static str,
    /// A tool call's telling argument; a model call's model.
    pub detail: String,
    /// A tool result's size in characters.
    pub result_chars: Option<usize>,
    /// A model call's tokens.
    pub tokens: Option<Tokens>,
}

/// Tokens spent, and their cost in millionths of the price's currency when
/// every priced call had a price.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Tokens {
    /// Uncached input.
    pub input: u64,
    /// Output (reasoning included).
    pub output: u64,
    /// Input served from cache.
    pub cached: u64,
    /// Cost of the calls that had a price, millionths.
    pub cost: Option<u64>,
}

impl Tokens {
    fn add(&mut self, other: &Tokens) {
        self.input += other.input;
        self.output += other.output;
        self.cached += other.cached;
        self.cost = match (self.cost, other.cost) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        };
    }
}

/// A labelled stretch of time: a workflow phase or a Ralph round.
#[derive(Debug, Serialize, PartialEq)]
pub struct Band {
    /// `phase survey`, `round 2`.
    pub label: String,
    /// Began, ms since epoch.
    pub start: u64,
    /// Ended.
    pub end: u64,
}

/// `GET /api/timeline/{node}`.
pub(super) async fn timeline(State(api): State<Api>, Path(id): Path<String>) -> Response {
    let Ok(node) = id.parse::<u64>() else {
        return error(
            StatusCode::BAD_REQUEST,
            "BAD_ID",
            format!("`{id}` is not a node id (a number)"),
        );
    };
    let tree = api.rt.tree();
    let mut all: BTreeMap<u64, NodeSnapshot> = BTreeMap::new();
    for n in tree.stopped_nodes().into_iter().chain(tree.snapshot()) {
        all.insert(n.id, n);
    }
    if !all.contains_key(&node) {
        return error(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("no node {node}, live or remembered"),
        );
    }
    let (agents, more) = agents_under(&all, node);
    let llm = api.rt.root().get::<LlmRuntime>(LlmRuntime::SERVICE);
    let store = api
        .rt
        .root()
        .get::<dyn SessionPersistence>(PERSISTENCE_SERVICE);
    let mut lanes = Vec::with_capacity(agents.len());
    let mut bands = Vec::new();
    let mut total = Tokens::default();
    for (agent, n, depth) in agents {
        let Some(events) = events_of(&api, store.clone(), &agent).await else {
            continue;
        };
        let mut lane = lane_of(&events, llm.as_deref());
        lane.agent = agent;
        lane.node = n.id;
        lane.depth = depth;
        lane.label = n.summary["label"].as_str().map(str::to_owned);
        // A lane begins when its agent did, not at its first record: a
        // coordinator's first record may come after its children's.
        if n.started_ms > 0 && (lane.start == 0 || n.started_ms < lane.start) {
            lane.start = n.started_ms;
        }
        total.add(&lane.tokens);
        bands.extend(bands_of(&events));
        lanes.push(lane);
    }
    lanes.sort_by_key(|l| (l.start, l.node));
    Json(json!({"node": node, "lanes": lanes, "bands": bands, "tokens": total, "more": more}))
        .into_response()
}

/// The agents at and below `node` (a node whose summary names its agent),
/// each once, in start order, with its node and depth; at most
/// [`MAX_LANES`], and how many more.
fn agents_under(
    all: &BTreeMap<u64, NodeSnapshot>,
    node: u64,
) -> (Vec<(String, NodeSnapshot, usize)>, usize) {
    let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
    for n in all.values() {
        if let Some(p) = n.parent {
            children.entry(p).or_default().push(n.id);
        }
    }
    let mut found: Vec<(String, NodeSnapshot, usize)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut more = 0;
    let mut stack = vec![(node, 0usize)];
    while let Some((id, depth)) = stack.pop() {
        let Some(n) = all.get(&id) else { continue };
        if let Some(agent) = n.summary["agent"].as_str()
            && seen.insert(agent.to_owned())
        {
            if found.len() < MAX_LANES {
                found.push((agent.to_owned(), n.clone(), depth));
            } else {
                more += 1;
            }
        }
        // Children in reverse, so the first is walked first.
        if let Some(kids) = children.get(&id) {
            stack.extend(kids.iter().rev().map(|k| (*k, depth + 1)));
        }
    }
    (found, more)
}

/// A session's events as JSON: the live agent's, else the store's.
async fn events_of(
    api: &Api,
    store: Option<Arc<dyn SessionPersistence>>,
    agent: &str,
) -> Option<Vec<Value>> {
    if let Some(live) = super::agents::by_id(&api.rt, agent) {
        return Some(
            live.session()
                .events_from(0)
                .iter()
                .map(|e| e.to_json())
                .collect(),
        );
    }
    let store = store?;
    let id = agent.to_owned();
    let read = tokio::task::spawn_blocking(move || store.read_from(&id, 0)).await;
    match read {
        Ok(Ok(events)) => Some(events.iter().map(|e| e.to_json()).collect()),
        _ => None,
    }
}

/// The lane of one session's `events` (agent, node and depth left to the
/// caller); `llm` prices the model calls.
pub fn lane_of(events: &[Value], llm: Option<&LlmRuntime>) -> Lane {
    let mut lane = Lane::default();
    // Open calls: a model call by (turn, step), a tool call by its id.
    let mut models: HashMap<(u64, u64), usize> = HashMap::new();
    let mut tools: HashMap<String, usize> = HashMap::new();
    for e in events {
        let Some(time) = e["time"].as_u64() else {
            continue;
        };
        if lane.start == 0 {
            lane.start = time;
        }
        lane.end = lane.end.max(time);
        let d = &e["data"];
        let step = (
            d["turn"].as_u64().unwrap_or(0),
            d["step"].as_u64().unwrap_or(0),
        );
        match e["type"].as_str().unwrap_or("") {
            "step/start" => {
                models.insert(step, lane.spans.len());
                lane.spans.push(Span {
                    kind: "model",
                    name: format!("turn {} step {}", step.0, step.1),
                    start: time,
                    end: time,
                    status: "running",
                    ..Span::default()
                });
            }
            "assistant/chunk" => {
                if let Some(s) = models.get(&step).map(|i| &mut lane.spans[*i]) {
                    s.first_token.get_or_insert(time);
                    s.end = time;
                }
            }
            "assistant/message" => {
                if let Some(s) = models.remove(&step).map(|i| &mut lane.spans[i]) {
                    s.end = time;
                    s.status = "ok";
                    let source = &d["message"]["source"];
                    let (provider, model) = (
                        source["provider"].as_str().unwrap_or(""),
                        source["model"].as_str().unwrap_or(""),
                    );
                    s.detail = model.to_owned();
                    let u = &d["usage"];
                    let mut t = Tokens {
                        input: u["inputTokens"].as_u64().unwrap_or(0),
                        output: u["outputTokens"].as_u64().unwrap_or(0),
                        cached: u["cacheReadTokens"].as_u64().unwrap_or(0),
                        cost: None,
                    };
                    t.cost = llm
                        .and_then(|l| l.defaults(provider, model).price)
                        .map(|p| p.cost(t.input, t.cached, t.output));
                    lane.tokens.add(&t);
                    s.tokens = Some(t);
                }
            }
            "tool/call" => {
                let id = d["callId"].as_str().unwrap_or("").to_owned();
                let arguments = d["arguments"].as_str().unwrap_or("");
                tools.insert(id, lane.spans.len());
                lane.spans.push(Span {
                    kind: "tool",
                    name: d["name"].as_str().unwrap_or("tool").to_owned(),
                    start: time,
                    end: time,
                    status: "running",
                    detail: cut(&dsh_services::tools::telling_argument(arguments), 200),
                    ..Span::default()
                });
            }
            "tool/result" => {
                let result = d["message"]["content"]
                    .as_array()
                    .and_then(|c| c.iter().find(|b| b["type"] == "tool-result"));
                let Some(result) = result else { continue };
                let id = result["toolCallId"].as_str().unwrap_or("");
                if let Some(s) = tools.remove(id).map(|i| &mut lane.spans[i]) {
                    s.end = time;
                    s.status = if d["error"].is_null() { "ok" } else { "failed" };
                    let chars = result["content"].as_array().map_or(0, |blocks| {
                        blocks
                            .iter()
                            .filter_map(|b| b["text"].as_str())
                            .map(|t| t.chars().count())
                            .sum()
                    });
                    s.result_chars = Some(chars);
                }
            }
            "turn/end" => {
                // A step that gave no message ended with its turn.
                let failed = d["reason"]["kind"] != "completed";
                for i in std::mem::take(&mut models).into_values() {
                    let s = &mut lane.spans[i];
                    s.end = time;
                    s.status = if failed { "failed" } else { "ok" };
                }
            }
            _ => {}
        }
    }
    // What is still open runs to the lane's last event.
    for s in &mut lane.spans {
        if s.status == "running" {
            s.end = lane.end;
        }
    }
    lane
}

/// The phases and rounds a coordinator's `events` recorded: a workflow
/// phase from its first child's start to its last child's end; a Ralph
/// round from the loop's start (or the previous round's record) to its own.
pub fn bands_of(events: &[Value]) -> Vec<Band> {
    let mut bands: Vec<Band> = Vec::new();
    // Workflow children: child session -> the band of its phase.
    let mut phase_of: HashMap<String, usize> = HashMap::new();
    let mut round_from = None;
    for e in events {
        let Some(time) = e["time"].as_u64() else {
            continue;
        };
        let d = &e["data"];
        match e["type"].as_str().unwrap_or("") {
            "workflow/agent-start" | "tool-workflow/agent-start" => {
                let Some(phase) = d["phase"].as_str() else {
                    continue;
                };
                let label = format!("phase {phase}");
                let at = match bands.iter().rposition(|b| b.label == label) {
                    Some(i) => i,
                    None => {
                        bands.push(Band {
                            label,
                            start: time,
                            end: time,
                        });
                        bands.len() - 1
                    }
                };
                if let Some(child) = d["child"].as_str() {
                    phase_of.insert(child.to_owned(), at);
                }
            }
            "workflow/agent-end" | "tool-workflow/agent-end" => {
                if let Some(b) = d["child"]
                    .as_str()
                    .and_then(|c| phase_of.get(c))
                    .map(|i| &mut bands[*i])
                {
                    b.end = b.end.max(time);
                }
            }
            "ralph/start" => round_from = Some(time),
            "ralph/round" => {
                let start = round_from.unwrap_or(time);
                bands.push(Band {
                    label: format!("round {}", d["round"].as_u64().unwrap_or(0)),
                    start,
                    end: time,
                });
                round_from = Some(time);
            }
            _ => {}
        }
    }
    bands
}

/// `text` cut to `n` characters.
fn cut(text: &str, n: usize) -> String {
    match text.char_indices().nth(n) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: &str, time: u64, data: Value) -> Value {
        json!({"type": kind, "seq": 0, "time": time, "data": data})
    }

    #[test]
    fn a_lane_has_a_bar_per_model_call_and_tool_call_with_their_times_and_tokens() {
        let events = [
            event("turn/start", 100, json!({"turn": 1})),
            event("step/start", 100, json!({"turn": 1, "step": 1})),
            event("assistant/chunk", 130, json!({"turn": 1, "step": 1})),
            event("assistant/chunk", 150, json!({"turn": 1, "step": 1})),
            event(
                "assistant/message",
                160,
                json!({"turn": 1, "step": 1, "usage": {"inputTokens": 10, "outputTokens": 5, "cacheReadTokens": 4},
                    "message": {"source": {"provider": "p", "model": "m"}}}),
            ),
            event(
                "tool/call",
                161,
                json!({"callId": "c1", "name": "bash", "arguments": "{\"command\":\"ls -la\"}"}),
            ),
            event(
                "tool/result",
                190,
                json!({"error": {"code": "EXIT"}, "message": {"content": [
                    {"type": "tool-result", "toolCallId": "c1", "content": [{"type": "text", "text": "nope"}]}]}}),
            ),
            // A step whose model call never answered: its turn ended it.
            event("step/start", 200, json!({"turn": 1, "step": 2})),
            event(
                "turn/end",
                250,
                json!({"turn": 1, "reason": {"kind": "error"}}),
            ),
        ];
        let lane = lane_of(&events, None);
        assert_eq!((lane.start, lane.end), (100, 250));
        assert_eq!(lane.spans.len(), 3, "{:#?}", lane.spans);
        let model = &lane.spans[0];
        assert_eq!(
            (
                model.kind,
                model.start,
                model.first_token,
                model.end,
                model.status
            ),
            ("model", 100, Some(130), 160, "ok")
        );
        assert_eq!(model.detail, "m");
        let tool = &lane.spans[1];
        assert_eq!(
            (tool.kind, tool.start, tool.end, tool.status),
            ("tool", 161, 190, "failed")
        );
        assert_eq!(tool.detail, "ls -la");
        assert_eq!(tool.result_chars, Some(4));
        let cut_short = &lane.spans[2];
        assert_eq!((cut_short.end, cut_short.status), (250, "failed"));
        assert_eq!(
            lane.tokens,
            Tokens {
                input: 10,
                output: 5,
                cached: 4,
                cost: None
            }
        );
    }

    #[test]
    fn phases_span_their_children_and_rounds_follow_each_other() {
        let a = "00000000-0000-0000-0000-00000000000a";
        let b = "00000000-0000-0000-0000-00000000000b";
        let events = [
            event(
                "tool-workflow/agent-start",
                10,
                json!({"seq": 1, "phase": "survey", "child": a}),
            ),
            event(
                "tool-workflow/agent-start",
                12,
                json!({"seq": 2, "phase": "verify", "child": b}),
            ),
            event("tool-workflow/agent-end", 40, json!({"child": a})),
            event("tool-workflow/agent-end", 55, json!({"child": b})),
            event("ralph/start", 60, json!({})),
            event("ralph/round", 70, json!({"round": 1})),
            event("ralph/round", 95, json!({"round": 2})),
        ];
        let bands = bands_of(&events);
        let seen: Vec<(&str, u64, u64)> = bands
            .iter()
            .map(|b| (b.label.as_str(), b.start, b.end))
            .collect();
        assert_eq!(
            seen,
            [
                ("phase survey", 10, 40),
                ("phase verify", 12, 55),
                ("round 1", 60, 70),
                ("round 2", 70, 95)
            ]
        );
    }
}
