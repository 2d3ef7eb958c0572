//! What crosses the wire between nodes: one message type, [`HostMsg`],
//! whose payloads are JSON documents. Every other message type of the
//! runtime is local (`ractor` advertises only serialisable actors to peers).
//!
//! The bytes are parsed once, by the receiving host ([`Request::parse`]);
//! a payload that does not parse is answered with a `BAD_REQUEST` error,
//! never a panic, whoever sent it.

use dsh_supervisors::error::chain;
use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::{Message, RpcReplyPort};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use dsh_services::approval::ApprovalPolicy;
use dsh_services::llm::TokenUsage;
use dsh_services::sandbox::Policy;
use dsh_services::session::TurnEndReason;

/// The largest request a host reads (a prompt with its options).
pub const MAX_REQUEST: usize = 4 << 20;

/// A message to a node's host.
pub enum HostMsg {
    /// A request answered on `reply`.
    Call {
        /// A [`Request`] as JSON.
        request: Vec<u8>,
        /// Where the answer (a [`Reply`] as JSON) goes.
        reply: RpcReplyPort<Vec<u8>>,
    },
    /// A notice that needs no answer.
    Cast {
        /// A [`Notice`] as JSON.
        notice: Vec<u8>,
    },
}

const CALL: &str = "call";
const CAST: &str = "cast";

impl Message for HostMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        Ok(match self {
            HostMsg::Call { request, reply } => SerializedMessage::Call {
                variant: CALL.into(),
                args: request,
                reply,
                metadata: None,
            },
            HostMsg::Cast { notice } => SerializedMessage::Cast {
                variant: CAST.into(),
                args: notice,
                metadata: None,
            },
        })
    }

    fn deserialize(bytes: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        match bytes {
            SerializedMessage::Call {
                variant,
                args,
                reply,
                ..
            } if variant == CALL => Ok(HostMsg::Call {
                request: args,
                reply,
            }),
            SerializedMessage::Cast { variant, args, .. } if variant == CAST => {
                Ok(HostMsg::Cast { notice: args })
            }
            _ => Err(BoxedDowncastErr),
        }
    }
}

/// A request to a host.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// Who are you, and how much room is left?
    Hello {},
    /// Create a child agent for a parent on another node.
    Open(Box<OpenChild>),
    /// Run one turn of a child on `prompt`; answered when it ends.
    Turn {
        /// The child's session id.
        child: String,
        /// The user message.
        prompt: String,
    },
    /// The node's whole supervision tree, as it is now.
    Tree {},
    /// What changed in the subtrees of the asking node's children since
    /// the answer numbered `cursor` (none, or not the last one sent: all of
    /// it, afresh); answered at once when something did, else within
    /// `WATCH_HOLD`.
    Watch {
        /// The asking node's name (whose children's subtrees are sent).
        node: String,
        /// The number of the last answer it applied.
        #[serde(default)]
        cursor: Option<u64>,
    },
    /// Dispose a child (ordered teardown of its subtree); answered when done.
    Close {
        /// The child's session id.
        child: String,
    },
}

/// A notice to a host.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Notice {
    /// Cancel a child's running turn.
    Cancel {
        /// The child's session id.
        child: String,
    },
    /// Dispose a child without waiting for it.
    Close {
        /// The child's session id.
        child: String,
    },
}

/// What a parent asks of a remote child.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OpenChild {
    /// The child's session id, chosen by the parent's side (so a close can
    /// follow an open whose answer was lost).
    pub child: String,
    /// The node the parent runs on.
    pub parent_node: String,
    /// The parent's session id (the child's `parentSession`).
    pub parent: String,
    /// The child's delegation depth.
    pub depth: u32,
    /// Display label.
    #[serde(default)]
    pub label: Option<String>,
    /// System text replacing the node's.
    #[serde(default)]
    pub persona: Option<String>,
    /// Tools the child may use (`None`: all of the node's).
    #[serde(default)]
    pub allow: Option<Vec<String>>,
    /// Tools the child may not use.
    #[serde(default)]
    pub deny: Vec<String>,
    /// The parent's policy: the child gets at most this (and at most the
    /// node's own).
    pub policy: Policy,
    /// The child's approval policy as its parent delegates it: `always`
    /// passes on; anything else is `never` (a child never asks a human).
    pub approval: ApprovalPolicy,
    /// A structured result's object schema (the child gets a `report` tool).
    #[serde(default)]
    pub output_schema: Option<Value>,
    /// The parent's model route and id; used when the node has that route.
    #[serde(default)]
    pub route: Option<(String, String)>,
}

/// A host's description of itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hello {
    /// The node's name.
    pub node: String,
    /// How many children it takes at most.
    pub max_agents: u32,
    /// How many it holds now.
    pub agents: u32,
}

/// A node's tree.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TreeView {
    /// The node's name.
    pub node: String,
    /// The tree as `dsh tree` prints it.
    pub text: String,
    /// The tree's nodes, as the API serves them.
    pub nodes: Value,
    /// The nodes stopped lately, each with its global stop sequence number.
    #[serde(default)]
    pub stopped: Value,
}

/// How long a host holds a [`Request::Watch`] when nothing changes.
pub const WATCH_HOLD: std::time::Duration = std::time::Duration::from_secs(10);

/// The subtrees of a parent node's children on a host, as they changed
/// (the answer to [`Request::Watch`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Changes {
    /// This answer's number (the next watch names it).
    pub cursor: u64,
    /// Everything follows afresh: nodes seen before and not sent again
    /// (in this answer or the ones that follow while `more` is set) are gone.
    #[serde(default)]
    pub reset: bool,
    /// More changes are queued; the next watch is answered at once.
    #[serde(default)]
    pub more: bool,
    /// Nodes that appeared or changed, parents before children, each as it
    /// is now.
    #[serde(default)]
    pub nodes: Vec<MirrorNode>,
    /// Nodes that stopped, in stop order.
    #[serde(default)]
    pub stopped: Vec<MirrorStop>,
}

/// A node of a child's subtree, as the host's tree has it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MirrorNode {
    /// Its id on the host.
    pub id: u64,
    /// Its parent's id on the host; `None` for a child's own node (an agent
    /// scope, or its parked node), which `child` names.
    pub parent: Option<u64>,
    /// The child whose node it is (the session id), set on a child's own node.
    #[serde(default)]
    pub child: Option<String>,
    /// What runs behind it.
    pub form: dsh_supervisors::tree::Form,
    /// Kind.
    pub kind: String,
    /// Name.
    pub name: String,
    /// Status.
    pub status: dsh_supervisors::Status,
    /// Start time, ms since epoch.
    pub started_ms: u64,
    /// Kind-specific summary.
    #[serde(default)]
    pub summary: Value,
}

/// A node that stopped on the host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MirrorStop {
    /// Its id on the host.
    pub id: u64,
    /// Its final status.
    pub status: dsh_supervisors::Status,
    /// Why.
    pub reason: String,
}

/// A child was created.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Opened {
    /// Its session id.
    pub child: String,
}

/// How a child's turn ended.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnDone {
    /// The final assistant text.
    pub text: String,
    /// Why the turn ended.
    pub reason: TurnEndReason,
    /// Tokens the turn spent.
    #[serde(default)]
    pub usage: TokenUsage,
    /// The `report` tool's arguments, when a schema was asked for.
    #[serde(default)]
    pub structured: Option<Value>,
}

/// A refusal, with a stable code.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct WireError {
    /// `BAD_REQUEST`, `NODE_FULL`, `NOT_FOUND`, `START_FAILED`, ...
    pub code: String,
    /// What went wrong.
    pub message: String,
}

impl WireError {
    /// An error with `code`.
    pub fn new(code: &str, message: impl Into<String>) -> WireError {
        WireError {
            code: code.into(),
            message: message.into(),
        }
    }
}

/// An answer: `{"ok": …}` or `{"error": {code, message}}`.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
enum Reply<T> {
    Ok(T),
    Error(WireError),
}

impl Request {
    /// Reads a request; a payload that is too large or does not parse is
    /// refused with what was wrong.
    pub fn parse(bytes: &[u8]) -> Result<Request, WireError> {
        read("request", bytes)
    }

    /// The request as bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

impl Notice {
    /// Reads a notice.
    pub fn parse(bytes: &[u8]) -> Result<Notice, WireError> {
        read("notice", bytes)
    }

    /// The notice as bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// A peer's `what` (a request or a notice): at most [`MAX_REQUEST`] bytes of
/// JSON of its shape, else `BAD_REQUEST` saying which.
fn read<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, WireError> {
    if bytes.len() > MAX_REQUEST {
        return Err(WireError::new(
            "BAD_REQUEST",
            format!(
                "the {what} is {} bytes; at most {MAX_REQUEST} are read",
                bytes.len()
            ),
        ));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| WireError::new("BAD_REQUEST", format!("the {what}: {}", chain(&e))))
}

/// An answer as bytes.
pub fn answer<T: Serialize>(result: Result<T, WireError>) -> Vec<u8> {
    let reply = match result {
        Ok(v) => Reply::Ok(v),
        Err(e) => Reply::Error(e),
    };
    serde_json::to_vec(&reply).unwrap_or_default()
}

/// Reads an answer; one that does not parse is a `BAD_ANSWER` error.
pub fn read_answer<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, WireError> {
    match serde_json::from_slice::<Reply<T>>(bytes) {
        Ok(Reply::Ok(v)) => Ok(v),
        Ok(Reply::Error(e)) => Err(e),
        Err(e) => Err(WireError::new("BAD_ANSWER", chain(&e).to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_hostile_bytes_are_refused_with_a_reason() {
        let r = Request::Turn {
            child: "c1".into(),
            prompt: "hi".into(),
        };
        assert!(matches!(
            Request::parse(&r.encode()),
            Ok(Request::Turn { child, .. }) if child == "c1"
        ));
        for bad in [
            &b"not json"[..],
            br#"{"op":"turn"}"#,
            br#"{"op":"launch-missiles"}"#,
            br#"{"op":"hello","extra":1}"#,
        ] {
            let e = Request::parse(bad).err();
            assert_eq!(e.map(|e| e.code), Some("BAD_REQUEST".into()), "{bad:?}");
        }
        let huge = vec![b' '; MAX_REQUEST + 1];
        assert!(
            Request::parse(&huge)
                .err()
                .is_some_and(|e| e.message.contains("at most"))
        );
        let ok: Result<Hello, _> = read_answer(&answer(Ok(Hello {
            node: "b".into(),
            max_agents: 4,
            agents: 1,
        })));
        assert_eq!(ok.map(|h| h.node), Ok("b".into()));
        let refused: Result<Hello, _> =
            read_answer(&answer::<Hello>(Err(WireError::new("NODE_FULL", "full"))));
        assert_eq!(refused.err().map(|e| e.code), Some("NODE_FULL".into()));
        let garbage: Result<Hello, _> = read_answer(b"[1,2]");
        assert_eq!(garbage.err().map(|e| e.code), Some("BAD_ANSWER".into()));
    }

    #[test]
    fn host_messages_cross_as_calls_and_casts_and_nothing_else_is_accepted() {
        let (tx, _rx) = ractor::concurrency::oneshot();
        let call = HostMsg::Call {
            request: Request::Hello {}.encode(),
            reply: tx.into(),
        };
        let wire = call.serialize();
        assert!(matches!(wire, Ok(SerializedMessage::Call { ref variant, .. }) if variant == CALL));
        let back = wire.and_then(HostMsg::deserialize);
        assert!(matches!(back, Ok(HostMsg::Call { .. })));
        let other = SerializedMessage::Cast {
            variant: "call".into(),
            args: vec![],
            metadata: None,
        };
        assert!(HostMsg::deserialize(other).is_err());
    }
}
