//! The session log: append validation, surface ops, derived history, forks,
//! the jsonl format, and the upstream harness's recorded logs.

use std::path::PathBuf;
use std::sync::Arc;

use dsh_services::llm::{ContentBlock, Message, MessageSource, Role, StreamChunk};
use dsh_services::session::jsonl::{self, LoadError};
use dsh_services::session::{
    EventData, SessionError, SessionEvent, SessionHeader, SessionLog, SurfaceIntent, SurfaceOp,
    TurnEndReason,
};

fn header() -> SessionHeader {
    SessionHeader::new("s-1", Some("/work".into()))
}

fn user(text: &str) -> EventData {
    EventData::UserMessage(Arc::new(Message::user_text(text)))
}

fn assistant(turn: u32, step: u32, text: &str) -> EventData {
    EventData::AssistantMessage {
        turn,
        step,
        message: Arc::new(Message {
            id: Message::new_id(),
            role: Role::Assistant,
            content: if text.is_empty() {
                vec![]
            } else {
                vec![ContentBlock::text(text)]
            },
            source: MessageSource::model("scripted", "echo"),
        }),
        usage: None,
        interrupted: false,
    }
}

/// One complete text turn; returns the seq of its user message.
fn text_turn(log: &mut SessionLog, turn: u32, prompt: &str, answer: &str) -> u64 {
    log.append(EventData::TurnStart { turn }, None, 1).unwrap();
    log.append(EventData::StepStart { turn, step: 1 }, None, 1)
        .unwrap();
    let u = log
        .append(user(prompt), Some(SurfaceIntent::append()), 1)
        .unwrap()
        .seq;
    log.append(
        assistant(turn, 1, answer),
        Some(SurfaceIntent::append_citing(vec![])),
        1,
    )
    .unwrap();
    log.append(EventData::StepEnd { turn, step: 1 }, None, 1)
        .unwrap();
    log.append(
        EventData::TurnEnd {
            turn,
            reason: Box::new(TurnEndReason::Completed),
        },
        None,
        1,
    )
    .unwrap();
    u
}

#[test]
fn seq_is_the_log_length_and_surface_metadata_is_enforced() {
    let mut log = SessionLog::new(header());
    let e = log
        .append(EventData::TurnStart { turn: 1 }, None, 5)
        .unwrap();
    assert_eq!((e.seq, e.time), (0, 5));
    let missing = log.append(user("hi"), None, 5).unwrap_err();
    assert_eq!(
        missing.to_string(),
        "event 1 (`user/message`): a message-producing event must declare its surfaceOp"
    );
    let misplaced = log
        .append(
            EventData::StepStart { turn: 1, step: 1 },
            Some(SurfaceIntent::append()),
            5,
        )
        .unwrap_err();
    assert!(
        misplaced
            .to_string()
            .contains("only user/message, assistant/message and tool/result")
    );
    let future = log
        .append(user("hi"), Some(SurfaceIntent::append_citing(vec![7])), 5)
        .unwrap_err();
    assert!(
        future
            .to_string()
            .contains("cites 7, which is not an earlier event"),
        "{future}"
    );
    let empty = log
        .append(user("hi"), Some(SurfaceIntent::append_citing(vec![])), 5)
        .unwrap_err();
    assert!(
        empty
            .to_string()
            .contains("may be empty only on assistant/message")
    );
    assert_eq!(log.next_seq(), 1, "refused appends write nothing");
}

#[test]
fn derived_history_is_shared_incremental_and_skips_empty_assistant_messages() {
    let mut log = SessionLog::new(header());
    text_turn(&mut log, 1, "one", "first");
    let first = log.derive_messages();
    assert_eq!(first.len(), 2);
    text_turn(&mut log, 2, "two", "");
    let second = log.derive_messages();
    assert_eq!(
        second.len(),
        3,
        "the empty assistant message is not history"
    );
    assert!(
        Arc::ptr_eq(&first[0], &second[0]),
        "messages are shared, not rebuilt"
    );
    let eighth = log.get(8).unwrap();
    let EventData::UserMessage(logged) = &eighth.data else {
        panic!("expected the second prompt")
    };
    assert!(Arc::ptr_eq(logged, &second[2]));
    assert_eq!(first.len(), 2, "an earlier snapshot does not grow");
    let roles: Vec<Role> = second.iter().map(|m| m.role).collect();
    assert_eq!(roles, [Role::User, Role::Assistant, Role::User]);
}

#[test]
fn replace_shadows_a_cited_range_and_rebuilds_history() {
    let mut log = SessionLog::new(header());
    let u1 = text_turn(&mut log, 1, "one", "first");
    text_turn(&mut log, 2, "two", "second");
    assert_eq!(log.derive_messages().len(), 4);
    let nodes = log.surface().nodes.clone();
    let summary = EventData::UserMessage(Arc::new(Message {
        id: Message::new_id(),
        role: Role::User,
        content: vec![ContentBlock::text("summary of turn 1")],
        source: MessageSource::plugin("compaction"),
    }));
    // Must cite every shadowed node.
    let partial = SurfaceIntent {
        surface_op: SurfaceOp::Replace {
            start: nodes[0],
            end: nodes[1],
        },
        source_event_seqs: Some(vec![nodes[0]]),
    };
    let err = log.append(summary.clone(), Some(partial), 9).unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("shadows node {}", nodes[1])),
        "{err}"
    );
    let bad_range = SurfaceIntent {
        surface_op: SurfaceOp::Replace { start: 2, end: 5 },
        source_event_seqs: Some(vec![2, 3, 4, 5]),
    };
    assert!(
        log.append(summary.clone(), Some(bad_range), 9)
            .unwrap_err()
            .to_string()
            .contains("not on the surface")
    );
    let ok = SurfaceIntent {
        surface_op: SurfaceOp::Replace {
            start: nodes[0],
            end: nodes[1],
        },
        source_event_seqs: Some(vec![nodes[0], nodes[1]]),
    };
    let replaced = log.append(summary, Some(ok), 9).unwrap();
    assert_eq!(log.surface().nodes, [replaced.seq, nodes[2], nodes[3]]);
    assert_eq!(log.surface().replace_generation, 1);
    let history = log.derive_messages();
    assert_eq!(history.len(), 3);
    assert_eq!(history[0].text(), "summary of turn 1");
    assert_eq!(u1, nodes[0]);
}

#[test]
fn forks_only_at_turn_boundaries_and_seeds_end_with_a_marker() {
    let mut log = SessionLog::new(header());
    text_turn(&mut log, 1, "one", "first");
    let boundary = log.next_seq() - 1;
    log.append(EventData::TurnStart { turn: 2 }, None, 1)
        .unwrap();
    let open = log.fork_prefix(None).unwrap_err();
    assert_eq!(
        open.to_string(),
        format!(
            "cannot fork at seq {}: turn 2 is still open there; fork at a turn boundary",
            boundary + 1
        )
    );
    assert!(matches!(
        log.fork_prefix(Some(99)),
        Err(SessionError::Fork { .. })
    ));
    let prefix = log.fork_prefix(Some(boundary)).unwrap();
    assert_eq!(prefix.len() as u64, boundary + 1);
    let mut child = SessionLog::from_seed(header(), prefix, 42).unwrap();
    assert_eq!(child.first_live_seq(), boundary + 1);
    assert!(matches!(
        child.iter().last().unwrap().data,
        EventData::EndSeed
    ));
    assert_eq!(child.derive_messages().len(), 2);
    // Reopening an untouched session does not add a second marker.
    let again = SessionLog::from_seed(header(), child.fork_prefix(None).unwrap(), 43).unwrap();
    assert_eq!(again.next_seq(), child.next_seq());
    // A seed with a gap is refused.
    let mut gap = log.fork_prefix(Some(boundary)).unwrap();
    gap.remove(1);
    assert!(matches!(
        SessionLog::from_seed(header(), gap, 1),
        Err(SessionError::Discontiguous {
            position: 1,
            seq: 2
        })
    ));
}

#[test]
fn jsonl_round_trips_and_refuses_what_it_cannot_interpret() {
    let mut log = SessionLog::new(header());
    text_turn(&mut log, 1, "one", "first");
    log.append(
        EventData::AssistantChunk {
            turn: 2,
            step: 1,
            chunk: Box::new(StreamChunk::TextDelta {
                index: 0,
                text: "x".into(),
            }),
        },
        None,
        3,
    )
    .unwrap();
    let text = jsonl::render(log.header(), &log.iter().collect::<Vec<_>>());
    let (h, events) = jsonl::parse(&text).unwrap();
    assert_eq!(&h, log.header());
    let original: Vec<SessionEvent> = log.iter().map(|e| e.as_ref().clone()).collect();
    assert_eq!(events, original);

    let newer = text.replacen("\"version\":0", "\"version\":3", 1);
    assert_eq!(
        jsonl::parse(&newer).unwrap_err().to_string(),
        "line 1: format version 3 was written by a newer dsh; this build reads version 0"
    );
    let torn = &text[..text.len() - 10];
    assert_eq!(
        jsonl::parse(torn).unwrap_err(),
        LoadError::TornTail { line: 8, good: 6 }
    );
    let unknown =
        format!("{text}{{\"type\":\"plugin/thing\",\"seq\":7,\"time\":1,\"data\":{{}}}}\n");
    assert!(
        jsonl::parse(&unknown)
            .unwrap_err()
            .to_string()
            .starts_with("line 9: unknown event type `plugin/thing` is not marked ignorable")
    );
    let skippable = format!(
        "{text}{{\"type\":\"plugin/thing\",\"seq\":7,\"time\":1,\"data\":{{}},\"ignorable\":true}}\n"
    );
    assert_eq!(jsonl::parse(&skippable).unwrap().1.len(), 8);
    let gap = text.replacen("\"seq\":3", "\"seq\":4", 1);
    assert_eq!(
        jsonl::parse(&gap).unwrap_err().to_string(),
        "line 5: seq 4 where 3 was expected (the log must be contiguous)"
    );
    let bad_payload =
        format!("{text}{{\"type\":\"tool/call\",\"seq\":7,\"time\":1,\"data\":{{\"turn\":1}}}}\n");
    assert!(
        jsonl::parse(&bad_payload)
            .unwrap_err()
            .to_string()
            .starts_with("line 9: `tool/call` event: missing field")
    );
}

fn conformance_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/dsh-sessions");
    assert!(
        dir.is_dir(),
        "the conformance recordings are missing at {}",
        dir.display()
    );
    dir
}

#[test]
fn every_upstream_recording_loads_and_derives() {
    let mut logs = 0;
    let mut packed = 0;
    for scenario in std::fs::read_dir(conformance_dir()).unwrap() {
        let scenario = scenario.unwrap().path();
        if !scenario.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&scenario).unwrap() {
            let path = file.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if !(name.starts_with("session") && name.ends_with(".jsonl")) {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let (header, events) =
                jsonl::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let count = events.len();
            let parsed = events.clone();
            let mut log = SessionLog::from_seed(header, events, 0)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            // Packed chunks read back as the events they were.
            let read: Vec<SessionEvent> = log.iter().take(count).map(|e| (*e).clone()).collect();
            assert_eq!(read, parsed, "{}", path.display());
            for e in &parsed {
                assert_eq!(log.get(e.seq).as_deref(), Some(e), "{}", path.display());
            }
            packed += log.packed_chunks();
            let messages = log.derive_messages();
            let turns = log.iter().filter(|e| e.kind() == "turn/start").count();
            assert!(turns == 0 || !messages.is_empty(), "{}", path.display());
            assert_eq!(log.first_live_seq() as usize, count);
            // Every tool call has its result, unless its turn was cancelled.
            let calls: Vec<Box<str>> = log
                .iter()
                .filter_map(|e| match &e.data {
                    EventData::ToolCall { call, .. } => Some(call.call_id.clone()),
                    _ => None,
                })
                .collect();
            let aborted = log.iter().any(|e| {
                matches!(
                    &e.data,
                    EventData::TurnEnd { reason, .. }
                        if matches!(**reason, TurnEndReason::Aborted { .. })
                )
            });
            for id in calls {
                let answered = messages.iter().any(|m| {
                    m.content.iter().any(|b| matches!(b, ContentBlock::ToolResult { tool_call_id, .. } if **tool_call_id == *id))
                });
                assert!(
                    answered || aborted,
                    "{}: call {id} has no result",
                    path.display()
                );
            }
            logs += 1;
        }
    }
    assert!(logs >= 10, "only {logs} recordings found");
    assert!(packed > 0, "no recorded chunk was packed");
}

/// A step's chunks, then its answer: text, a tool call, usage and finish.
fn streamed_step(log: &mut SessionLog, turn: u32, step: u32, times: &[u64]) -> Vec<SessionEvent> {
    use dsh_services::llm::{BlockType, FinishReason, TokenUsage};
    let usage = TokenUsage {
        input_tokens: 7,
        output_tokens: 3,
        ..TokenUsage::default()
    };
    let call = ContentBlock::ToolCall {
        id: "call_1".into(),
        name: "echo".into(),
        arguments: r#"{"i":1}"#.into(),
    };
    let chunks = [
        StreamChunk::BlockStart {
            index: 0,
            block_type: BlockType::Text,
        },
        StreamChunk::TextDelta {
            index: 0,
            text: "hel".into(),
        },
        StreamChunk::TextDelta {
            index: 0,
            text: "lo ✓".into(),
        },
        StreamChunk::BlockEnd {
            index: 0,
            block: ContentBlock::text("hello ✓"),
        },
        StreamChunk::ReasoningDelta {
            index: 1,
            text: "hmm".into(),
        },
        StreamChunk::BlockStart {
            index: 2,
            block_type: BlockType::ToolCall,
        },
        StreamChunk::ToolCallDelta {
            index: 2,
            id: "call_1".into(),
            name: Some("echo".into()),
            arguments_delta: r#"{"i":1}"#.into(),
        },
        StreamChunk::BlockEnd {
            index: 2,
            block: call.clone(),
        },
        StreamChunk::ToolCallDelta {
            index: 2,
            id: "call_1".into(),
            name: None,
            arguments_delta: String::new(),
        },
        // Not a block of the answer: kept whole.
        StreamChunk::BlockEnd {
            index: 9,
            block: ContentBlock::text("elsewhere"),
        },
        StreamChunk::ToolCallDelta {
            index: 9,
            id: "call_9".into(),
            name: Some("gone".into()),
            arguments_delta: "{".into(),
        },
        StreamChunk::Usage { usage },
        StreamChunk::Finish {
            reason: FinishReason::ToolCalls,
            replay_state: None,
        },
    ];
    let mut appended = Vec::new();
    for (i, chunk) in chunks.into_iter().enumerate() {
        let data = EventData::AssistantChunk {
            turn,
            step,
            chunk: Box::new(chunk),
        };
        let time = times[i % times.len()];
        appended.push((*log.append(data, None, time).unwrap()).clone());
    }
    let EventData::AssistantMessage { message, .. } = assistant(turn, step, "hello ✓") else {
        unreachable!()
    };
    let mut message = (*message).clone();
    message.content.push(call);
    let answer = EventData::AssistantMessage {
        turn,
        step,
        message: Arc::new(message),
        usage: Some(Box::new(usage)),
        interrupted: false,
    };
    let time = *times.last().unwrap();
    log.append(answer, Some(SurfaceIntent::append_citing(vec![])), time)
        .unwrap();
    appended
}

#[test]
fn a_steps_chunks_are_packed_once_answered_and_read_back_as_they_were() {
    let mut log = SessionLog::new(header());
    log.append(EventData::TurnStart { turn: 1 }, None, 1_000)
        .unwrap();
    log.append(user("hi"), Some(SurfaceIntent::append()), 1_000)
        .unwrap();
    let chunks = streamed_step(&mut log, 1, 1, &[1_000, 1_003, 1_003, 1_250]);
    assert_eq!(log.packed_chunks(), chunks.len(), "every chunk is packed");
    let read: Vec<SessionEvent> = log.iter().map(|e| (*e).clone()).collect();
    assert_eq!(&read[2..2 + chunks.len()], chunks.as_slice());
    for c in &chunks {
        assert_eq!(log.get(c.seq).as_deref(), Some(c), "seq {}", c.seq);
    }
    assert_eq!(log.iter_from(5).next().unwrap().seq, 5);
    assert!(
        log.without_chunks().all(|e| e.kind() != "assistant/chunk"),
        "without_chunks skips packed chunks"
    );
    assert_eq!(log.without_chunks().count(), 3);
    // The jsonl form of the log is what it was before packing.
    let text = jsonl::render(log.header(), &log.iter().collect::<Vec<_>>());
    let (_, parsed) = jsonl::parse(&text).unwrap();
    assert_eq!(parsed, read);
    // A fork and a restored log keep the chunks.
    let end = EventData::TurnEnd {
        turn: 1,
        reason: Box::new(TurnEndReason::Completed),
    };
    let read: Vec<SessionEvent> = log.iter().map(|e| (*e).clone()).collect();
    log.append(end, None, 1_300).unwrap();
    let prefix = log.fork_prefix(Some(read.len() as u64 - 1));
    assert!(prefix.is_err(), "the turn is still open before its end");
    let prefix = log.fork_prefix(None).unwrap();
    assert_eq!(prefix[..read.len()], read[..]);
    let read = prefix.clone();
    let again = SessionLog::restore(log.header().clone(), prefix, 0).unwrap();
    assert_eq!(again.packed_chunks(), chunks.len());
    assert_eq!(again.iter().map(|e| (*e).clone()).collect::<Vec<_>>(), read);
}

#[test]
fn chunks_that_do_not_fit_a_run_stay_as_they_were() {
    // A clock that stepped back: the step's chunks are not packed.
    let mut log = SessionLog::new(header());
    log.append(EventData::TurnStart { turn: 1 }, None, 5_000)
        .unwrap();
    let chunks = streamed_step(&mut log, 1, 1, &[5_000, 4_000]);
    assert_eq!(log.packed_chunks(), 0);
    let read: Vec<SessionEvent> = log
        .iter()
        .skip(1)
        .take(chunks.len())
        .map(|e| (*e).clone())
        .collect();
    assert_eq!(read, chunks);
    // Chunks of another step before the answer are not taken into its run.
    let mut log = SessionLog::new(header());
    log.append(EventData::TurnStart { turn: 1 }, None, 0)
        .unwrap();
    let stray = EventData::AssistantChunk {
        turn: 1,
        step: 7,
        chunk: Box::new(StreamChunk::TextDelta {
            index: 0,
            text: "stray".into(),
        }),
    };
    log.append(stray, None, 0).unwrap();
    let chunks = streamed_step(&mut log, 1, 1, &[0]);
    assert_eq!(log.packed_chunks(), chunks.len());
    let stray = log.get(1).unwrap();
    assert!(matches!(
        stray.data,
        EventData::AssistantChunk { step: 7, .. }
    ));
    assert_eq!(log.without_chunks().count(), 2);
}

#[test]
fn the_text_turn_recording_derives_the_expected_history() {
    let text = std::fs::read_to_string(conformance_dir().join("text-turn/session.jsonl")).unwrap();
    let (header, events) = jsonl::parse(&text).unwrap();
    assert_eq!(header.id, "539aa64c-7f37-40ff-abd8-ed45b717be1b");
    // Packed reasoning rows expand into one event per chunk: the assistant
    // message's sources are exactly the chunk events.
    let EventData::AssistantMessage { message, usage, .. } = &events
        .iter()
        .find(|e| e.kind() == "assistant/message")
        .unwrap()
        .data
    else {
        unreachable!()
    };
    let sources = events
        .iter()
        .find(|e| e.kind() == "assistant/message")
        .unwrap()
        .source_event_seqs()
        .unwrap()
        .to_vec();
    assert!(
        sources
            .iter()
            .all(|s| events[*s as usize].kind() == "assistant/chunk")
    );
    assert_eq!(message.text(), "PONG");
    assert_eq!(usage.as_ref().unwrap().input_tokens, 3091);
    let mut log = SessionLog::from_seed(header, events, 0).unwrap();
    let history = log.derive_messages();
    assert_eq!(history.len(), 3);
    assert_eq!(
        history[0].text(),
        "Reply with exactly the word: PONG. Do not use any tools."
    );
    assert_eq!(history[1].source.kind, "plugin");
    assert_eq!(history[2].text(), "PONG");
    assert_eq!(
        log.request_header().unwrap()["config"]["model"],
        "deepseek-v4-flash"
    );
}

mod loaders {
    use dsh_services::persistence::load_text;
    use dsh_services::session::SessionLog;
    use dsh_services::session::jsonl;
    use proptest::prelude::*;

    fn recording() -> String {
        std::fs::read_to_string(super::conformance_dir().join("tool-call-turn/session.jsonl"))
            .unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Arbitrary bytes: never a panic, always a typed answer.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let text = String::from_utf8_lossy(&bytes);
            let _ = jsonl::parse(&text);
            let _ = load_text(&text);
        }

        /// Any cut of a real log loads to a valid session (repaired) or is
        /// refused with a typed error; never a panic, never an invalid session.
        #[test]
        fn every_cut_of_a_real_log_loads_or_is_refused(fraction in 0.0f64..=1.0) {
            let full = recording();
            let mut at = ((full.len() as f64) * fraction) as usize;
            while !full.is_char_boundary(at) {
                at -= 1;
            }
            if let Ok(loaded) = load_text(&full[..at]) {
                let count = loaded.events.len();
                let log = SessionLog::from_seed(loaded.header, loaded.events, 0);
                prop_assert!(log.is_ok(), "a loaded prefix must seed a session: {:?}", log.err());
                prop_assert!(log.unwrap().open_turn().is_none(), "repair closes every turn ({count} events)");
            }
        }

        /// Garbage lines inserted into a real log are refused with their line.
        #[test]
        fn a_garbage_line_is_refused_with_its_number(line in 2usize..40, junk in "[a-z{}\\[\\]:,\"]{1,40}") {
            let full = recording();
            let mut lines: Vec<&str> = full.lines().collect();
            let at = line.min(lines.len());
            lines.insert(at, &junk);
            let text = lines.join("\n") + "\n";
            if let Err(e) = jsonl::parse(&text) {
                prop_assert!(e.to_string().starts_with(&format!("line {}", at + 1)), "{e}");
            }
        }
    }
}
