mod openai;
mod persistence;
mod session;
mod tools;
