mod openai;
mod persistence;
mod schemas;
mod session;
mod tools;
