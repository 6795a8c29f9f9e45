// rhea over WebSocket (the `ws` package) against the broker's WebSocket listener.
// Usage: node client.js URL ADDRESS COUNT [USER PASSWORD]
// Sends COUNT messages to ADDRESS, receives them back on the same connection and
// prints one JSON line: {"sent": n, "received": [...bodies], "error": null | "..."}.
'use strict';
const rhea = require('rhea');
const WebSocket = require('ws');

const [url, address, countText, username, password] = process.argv.slice(2);
const count = parseInt(countText, 10);
const container = rhea.create_container({id: 'ws-' + process.pid});
const ws = container.websocket_connect(WebSocket);
const options = {
  connection_details: ws(url, ['amqp'], {rejectUnauthorized: false}),
  reconnect: false,
};
if (username) {
  options.username = username;
  options.password = password;
}
const result = {sent: 0, received: [], error: null};
const finish = (error) => {
  if (error) result.error = error;
  console.log(JSON.stringify(result));
  process.exit(0);
};
setTimeout(() => finish('timed out'), 20000);

const conn = container.connect(options);
conn.on('connection_error', (ctx) => finish('connection error: ' + JSON.stringify(ctx.connection.error)));
conn.on('disconnected', (ctx) => { if (result.received.length < count) finish('disconnected: ' + (ctx.error && ctx.error.message)); });
conn.on('receiver_error', (ctx) => finish('receiver error: ' + JSON.stringify(ctx.receiver.error)));
conn.on('sender_error', (ctx) => finish('sender error: ' + JSON.stringify(ctx.sender.error)));
conn.on('message', (ctx) => {
  result.received.push(ctx.message.body);
  if (result.received.length === count) conn.close();
});
conn.on('connection_close', () => finish(null));
conn.once('receiver_open', () => conn.open_sender(address));
conn.on('sendable', (ctx) => {
  while (ctx.sender.sendable() && result.sent < count) {
    ctx.sender.send({body: 'ws-' + result.sent, durable: true});
    result.sent += 1;
  }
});
conn.open_receiver({source: {address: address}, autoaccept: true});
