// Answers an approval from the dashboard in headless Chromium.
// Usage: node approvals.cjs <base-url>
// Waits for the pending ask the Rust test causes, checks what it shows,
// clicks "allow once", opens the agent's conversation, and prints a JSON
// line with what it saw.
"use strict";
const { WAIT, run } = require("./browser.cjs");

const [base] = process.argv.slice(2);

run(async (browser) => {
  const page = await browser.newPage();
  await page.goto(base);
  await page.waitForSelector("#approvals li.approval", { timeout: WAIT });
  const shown = await page.locator("#approvals li.approval").first().textContent();
  await page.locator('#approvals button[data-outcome="allowed-once"]').first().click();
  await page.waitForFunction(
    () => document.getElementById("approvals").hidden, null, { timeout: WAIT });
  // The agent's conversation shows the question under its call, answered.
  await page.locator('[data-name^="scope/agent/"]').first().click();
  await page.waitForSelector('#conversation .msg.tool .approval[data-outcome]', { timeout: WAIT });
  const answered = await page.locator("#conversation .approval").first().textContent();
  console.log(JSON.stringify({ shown, answered }));
});
