// Reads mirrored nodes (nodes of another machine) off the dashboard in
// headless Chromium. Usage: node mirror.cjs <base-url>
// Waits for the rows the Rust test put in the tree, and prints a JSON line
// with their text, their status and whether the hostile kind ran.
"use strict";
const { WAIT, run } = require("./browser.cjs");

const [base] = process.argv.slice(2);

run(async (browser) => {
  const page = await browser.newPage();
  await page.goto(base);
  await page.waitForSelector('[data-name="scope/subagent/m1"]', { timeout: WAIT });
  await page.waitForSelector('[data-name="driver/m1"][data-status="lost"]', { timeout: WAIT });
  const scope = await page.locator('[data-name="scope/subagent/m1"]').first().textContent();
  const driver = await page.locator('[data-name="driver/m1"]').first().textContent();
  const injected = await page.evaluate(
    () => document.querySelectorAll("#tree img").length + (window.pwned ? 1 : 0));
  console.log(JSON.stringify({ scope, driver, injected }));
});
