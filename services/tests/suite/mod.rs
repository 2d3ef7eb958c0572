mod instructions;
mod openai;
mod persistence;
mod sandbox;
mod schemas;
mod session;
mod tools;
mod web;
