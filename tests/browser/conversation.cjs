// Reads an agent's conversation off the dashboard in headless Chromium and
// saves a screenshot. Usage: node conversation.cjs <base-url> <png-path>
// Prints a JSON line with the conversation's messages (class and text).
"use strict";
const { WAIT, run } = require("./browser.cjs");

const [base, png] = process.argv.slice(2);

run(async (browser) => {
  const page = await browser.newPage({ viewport: { width: 1400, height: 800 } });
  await page.goto(base);
  await page.waitForSelector(`#state:text("live")`, { timeout: WAIT });
  await page.locator('[data-name^="scope/agent/"]').first().click();
  await page.waitForSelector('#conversation .msg.tool[data-result="1"]', { timeout: WAIT });
  await page.waitForSelector("#conversation .msg.hook", { timeout: WAIT });
  const messages = await page.$$eval("#conversation .msg", (ms) => ms.map((m) => ({
    class: m.className, text: m.textContent,
    strong: [...m.querySelectorAll("strong")].map((s) => s.textContent),
    code: [...m.querySelectorAll("code")].map((s) => s.textContent),
  })));
  await page.screenshot({ path: png, fullPage: true });
  console.log(JSON.stringify({ messages }));
});
