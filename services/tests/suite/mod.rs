mod session;
