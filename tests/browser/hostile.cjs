// Shows a session whose model answered with HTML and a Markdown image, in
// headless Chromium, and reports whether anything ran or was fetched.
// Usage: node hostile.cjs <base-url> <sink-port>
"use strict";
const { WAIT, run } = require("./browser.cjs");

const [base, sink] = process.argv.slice(2);

run(async (browser) => {
  const page = await browser.newPage();
  const requests = [];
  page.on("request", (r) => { if (r.url().includes(":" + sink)) requests.push(r.url()); });
  const violations = [];
  page.on("console", (m) => { if (/Content Security Policy/.test(m.text())) violations.push(m.text()); });
  await page.goto(base);
  await page.waitForSelector(`#state:text("live")`, { timeout: WAIT });
  await page.locator('[data-name^="scope/agent/"]').first().click();
  await page.waitForSelector('#conversation .msg.assistant', { timeout: WAIT });
  const shown = await page.locator('#conversation .msg.assistant').first().textContent();
  const seen = await page.evaluate(() => ({
    images: document.querySelectorAll("img").length,
    scripts: document.querySelectorAll("script").length,
    pwned: window.pwned || null,
  }));
  console.log(JSON.stringify({ shown, requests, violations, ...seen }));
});
