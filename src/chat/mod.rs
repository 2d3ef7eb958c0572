//! `dsh chat`: an interactive session on one resident agent. This first
//! part reads what the user types (`input`); the session engine, the
//! transcript mode and the commands' actions come next (issue 42).

pub mod input;
