// The tour's workflow: three subagents in parallel, one line each.
// cargo run --release -- workflow demo/fan.js --demo-model --dashboard --hold
const topics = ['actors', 'supervision', 'teardown'];
const lines = await Promise.all(topics.map(t => agent('Write one line about ' + t + '.', {label: t})));
return {lines};
