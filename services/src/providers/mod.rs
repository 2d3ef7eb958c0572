//! The model providers: each an [`LlmAdapter`](crate::llm::LlmAdapter)
//! registered on routes of the `llm` service. The relays that stand for a
//! child running elsewhere (an ACP agent process, a child on another node)
//! are providers of the subagent seam, not here.
//!
//! - [`openai`]: any OpenAI-compatible endpoint (OpenAI, vLLM, llama.cpp,
//!   Ollama, DeepSeek's dialect), streaming, with retries.
//! - [`scripted`]: a script of steps, for keyless and deterministic runs.
//! - [`replay`]: a recorded session's model output, step by step.
//! - [`demo`]: the keyless demo model, a pure function of the conversation.

pub mod demo;
pub mod openai;
pub mod replay;
pub mod scripted;
