// Starts an agent from the dashboard's form in headless Chromium, waits
// for its answer, sends it a follow-up from its conversation view, and
// saves a screenshot. Usage: node start.cjs <url-with-token> <png-path>
// Prints one JSON line with what it saw.
"use strict";
const { WAIT, run } = require("./browser.cjs");

const [url, png] = process.argv.slice(2);

function step(name) { process.stderr.write(`start: ${name}\n`); }

run(async (browser) => {
  const page = await browser.newPage({ viewport: { width: 1400, height: 800 } });
  await page.goto(url);
  await page.waitForSelector(`#state:text("live")`, { timeout: WAIT });
  step("the form offers the routes and modes");
  await page.waitForSelector("#starter:not([hidden])", { timeout: WAIT });
  await page.locator("#starter summary").click();
  const routes = await page.$$eval("#start-route option", (os) => os.map((o) => o.textContent));
  const modes = await page.$$eval("#start-mode option", (os) => os.map((o) => o.textContent));
  const standing = await page.$eval("#start-mode", (s) => s.value);
  await page.fill("#start-prompt", "Write one line about supervision.");
  await page.selectOption("#start-mode", "read-only");
  await page.locator("#start").click();
  step("its answer");
  await page.waitForSelector("#conversation .msg.assistant", { timeout: WAIT });
  const said = await page.locator("#start-said").textContent();
  step("a follow-up from the conversation view");
  await page.fill("#say", "Now one line about teardown.");
  await page.locator("#followup").click();
  await page.waitForFunction(
    () => document.querySelectorAll("#conversation .msg.assistant").length >= 2, null, { timeout: WAIT });
  const users = await page.$$eval("#conversation .msg.user", (ms) => ms.map((m) => m.textContent));
  const answers = await page.$$eval("#conversation .msg.assistant", (ms) => ms.map((m) => m.textContent));
  const agent = await page.locator("#agent-id").textContent();
  // The progress line follows the turns.
  await page.waitForFunction(() => /^turn 2 step 0 idle/.test(document.getElementById("progress").textContent), null, { timeout: WAIT });
  const progress = await page.locator("#progress").textContent();
  await page.screenshot({ path: png, fullPage: true });
  console.log(JSON.stringify({ routes, modes, standing, said, users, answers, agent, progress }));
});
