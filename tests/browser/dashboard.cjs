// Drives the dashboard in headless Chromium (playwright-core + Debian chromium).
// Usage: node dashboard.cjs <base-url> <coordinator-node-id>
// Prints READY once the page is live (the Rust test then starts a workflow),
// and a final JSON line with what it saw. Exits non-zero on any failure.
"use strict";
const { WAIT, run } = require("./browser.cjs");
const readline = require("readline");

const [base, coordinator] = process.argv.slice(2);

function step(name) { process.stderr.write(`dashboard: ${name}\n`); }

run(async (browser) => {
  const page = await browser.newPage();
  await page.goto(base);
  await page.waitForSelector(`#state:text("live")`, { timeout: WAIT });
  const before = await page.locator('[data-name^="scope/subagent/"]').count();
  console.log("READY");
  // The test starts the workflow now: the tree grows.
  step("waiting for three subagents");
  await page.waitForFunction(
    () => document.querySelectorAll('[data-name^="scope/subagent/"]').length >= 3,
    null, { timeout: WAIT });
  const grown = await page.locator('[data-name^="scope/subagent/"]').count();
  // Each child is called by its workflow label, and the search finds it.
  await page.waitForFunction(
    () => [...document.querySelectorAll('[data-name^="scope/subagent/"]')].every((r) => /«worker \d»/.test(r.textContent)),
    null, { timeout: WAIT });
  const labels = await page.$$eval('[data-name^="scope/subagent/"]', (rows) => rows.map((r) => r.querySelector(".label").textContent).sort());
  await page.fill("#search", "worker 2");
  // The tree is redrawn at the next frame.
  await page.waitForSelector(".row.match", { timeout: WAIT });
  const found = await page.$$eval(".row.match", (rows) => rows.map((r) => r.querySelector(".label") && r.querySelector(".label").textContent));
  await page.fill("#search", "");

  step("a child's events");
  await page.locator('[data-name^="scope/subagent/"]').first().click();
  await page.waitForSelector('#conversation .msg.tool', { timeout: WAIT });
  await page.waitForSelector('#events li[data-type="tool/call"]', { timeout: WAIT, state: "attached" });
  const events = await page.locator("#events li").count();

  step("the coordinator's conversation links its children's sessions");
  await page.locator(`[data-node-id="${coordinator}"]`).first().click();
  await page.waitForSelector("#cancel", { timeout: WAIT });
  await page.waitForSelector("#conversation a.session-link", { timeout: WAIT });
  const links = await page.locator("#conversation a.session-link").count();
  await page.locator("#conversation a.session-link").first().click();
  await page.waitForSelector('#detail h3:text("session ")', { timeout: WAIT });
  await page.waitForSelector("#conversation .msg.user", { timeout: WAIT });
  const linked = await page.locator("#conversation .msg.user").first().textContent();

  step("cancel the coordinator from the page");
  await page.locator(`[data-node-id="${coordinator}"]`).first().click();
  await page.waitForSelector("#cancel", { timeout: WAIT });
  await page.locator("#cancel").click();
  await page.waitForFunction(
    () => document.querySelectorAll('[data-name^="scope/subagent/"]:not([data-stopped])').length === 0,
    null, { timeout: WAIT });
  // The stopped children stay in the tree, dimmed, with how they ended;
  // a click shows one's final state.
  const kept = await page.locator('[data-name^="scope/subagent/"][data-stopped]').count();
  await page.locator('[data-name^="scope/subagent/"][data-stopped]').first().click();
  await page.waitForFunction(() => {
    const t = document.getElementById("detail").textContent;
    return t.includes("scope/subagent/") && /disposed|stopped/.test(t);
  }, null, { timeout: WAIT });
  const final = await page.locator("#detail").textContent();

  step("the teardown view");
  await page.locator(`[data-node-id="${coordinator}"]`).first().click();
  await page.waitForFunction(
    () => document.querySelectorAll('#teardown li').length >= 3, null, { timeout: WAIT });
  const order = await page.$$eval("#teardown li", (lis) => lis.map((li) => ({
    seq: +li.dataset.stopSeq, text: li.textContent,
  })));
  console.log(JSON.stringify({ before, grown, events, order, kept, final, labels, found, links, linked }));
});
