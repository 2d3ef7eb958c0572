mod openai;
mod session;
mod tools;
