#!/usr/bin/env node
// rhea client for the amqpbroker interop scenarios (see interop/README.md).
//
//   node client.js --url amqp://127.0.0.1:5672 --scenario NAME --role ROLE [options]
//
// Prints JSON lines on stdout: progress events ({"event": "ready"} once its links are
// attached) and, last, one result line {"result": "pass"|"fail", "error": ..., ...}.
// Exit status 0 on pass, 1 on fail, 2 on bad usage.
'use strict';

const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const rhea = require('rhea');
const rheaMessage = require('rhea/lib/message.js');

const types = rhea.types;
const CLIENT = 'rhea';
const SELECTOR_DESCRIPTOR = 0x0000468C00000004;
const RHEA_VERSION = require('rhea/package.json').version;

// rhea unwraps received values into plain JavaScript (a uint and an int both become a
// number); keep the encoded message so the types scenario can read it with rhea's typed
// Reader instead.
const originalDecode = rheaMessage.decode;
rheaMessage.decode = function (buffer) {
    const msg = originalDecode(buffer);
    Object.defineProperty(msg, '__raw', {value: Buffer.from(buffer), enumerable: false});
    return msg;
};

function emit(obj) {
    process.stdout.write(JSON.stringify(obj) + '\n');
}

// ------------------------------------------------------------------ arguments

function parseArgs(argv) {
    const args = {
        url: 'amqp://127.0.0.1:5672', scenario: null, role: 'run', address: 'interop.queue', count: 1000,
        size: 1024 * 1024, sub: 'interop-sub', 'container-id': 'interop-rhea-' + crypto.randomUUID(),
        'link-name': null, idle: 1.5, timeout: 30, 'types-file': path.join(__dirname, '..', 'types.json'),
        'exclude-types': '',
    };
    for (let i = 0; i < argv.length; i++) {
        const a = argv[i];
        if (!a.startsWith('--')) throw new Error('unexpected argument ' + a);
        const key = a.slice(2);
        if (!(key in args)) throw new Error('unknown option ' + a);
        const val = argv[++i];
        if (val === undefined) throw new Error('missing value for ' + a);
        args[key] = ['count', 'size', 'idle', 'timeout'].includes(key) ? Number(val) : val;
    }
    if (!args.scenario) throw new Error('--scenario is required');
    args.excluded = new Set(args['exclude-types'].split(',').filter(Boolean));
    return args;
}

// ------------------------------------------------------------------ canonical types

const TYPECODES = {
    boolean: 0x56, ubyte: 0x50, ushort: 0x60, uint: 0x70, ulong: 0x80, byte: 0x51, short: 0x61, int: 0x71,
    long: 0x81, float: 0x72, double: 0x82, decimal32: 0x74, decimal64: 0x84, decimal128: 0x94, char: 0x73,
    timestamp: 0x83, uuid: 0x98, binary: 0xb0, string: 0xb1, symbol: 0xb3,
};
const NAMES_BY_CODE = {
    0x40: 'null', 0x56: 'boolean', 0x41: 'boolean', 0x42: 'boolean', 0x50: 'ubyte', 0x60: 'ushort',
    0x70: 'uint', 0x52: 'uint', 0x43: 'uint', 0x80: 'ulong', 0x53: 'ulong', 0x44: 'ulong', 0x51: 'byte',
    0x61: 'short', 0x71: 'int', 0x54: 'int', 0x81: 'long', 0x55: 'long', 0x72: 'float', 0x82: 'double',
    0x74: 'decimal32', 0x84: 'decimal64', 0x94: 'decimal128', 0x73: 'char', 0x83: 'timestamp', 0x98: 'uuid',
    0xa0: 'binary', 0xb0: 'binary', 0xa1: 'string', 0xb1: 'string', 0xa3: 'symbol', 0xb3: 'symbol',
    0x45: 'list', 0xc0: 'list', 0xd0: 'list', 0xc1: 'map', 0xd1: 'map', 0xe0: 'array', 0xf0: 'array',
};

function u64(v) { const b = Buffer.alloc(8); b.writeBigUInt64BE(BigInt(v)); return b; }
function i64(v) { const b = Buffer.alloc(8); b.writeBigInt64BE(BigInt(v)); return b; }
function uuidBuf(s) { return Buffer.from(s.replace(/-/g, ''), 'hex'); }
function uuidStr(b) {
    const h = b.toString('hex');
    return [h.slice(0, 8), h.slice(8, 12), h.slice(12, 16), h.slice(16, 20), h.slice(20)].join('-');
}

// The raw (element) value rhea's Writer expects for a fixed or variable width type.
function rawValue(t, v) {
    switch (t) {
    case 'boolean': return v ? 1 : 0;
    case 'ulong': return u64(v);
    case 'long': return i64(v);
    case 'decimal32': case 'decimal64': case 'decimal128': case 'binary': return Buffer.from(v, 'hex');
    case 'char': return v.codePointAt(0);
    case 'uuid': return uuidBuf(v);
    default: return v;
    }
}

function fromCanonical(c) {
    const t = c.type, v = c.value;
    switch (t) {
    case 'null': return types.Null();
    case 'boolean': return types.wrap_boolean(v);
    case 'ubyte': return types.Ubyte(v);
    case 'ushort': return types.Ushort(v);
    case 'uint': return types.wrap_uint(v);
    case 'ulong': return types.wrap_ulong(u64(v));
    case 'byte': return types.Byte(v);
    case 'short': return types.Short(v);
    case 'int': return types.wrap_int(v);
    case 'long': return types.wrap_long(i64(v));
    case 'float': return types.Float(v);
    case 'double': return types.Double(v);
    case 'decimal32': return types.Decimal32(Buffer.from(v, 'hex'));
    case 'decimal64': return types.Decimal64(Buffer.from(v, 'hex'));
    case 'decimal128': return types.Decimal128(Buffer.from(v, 'hex'));
    case 'char': return types.CharUTF32(v.codePointAt(0));
    case 'timestamp': return types.Timestamp(v);
    case 'uuid': return types.Uuid(uuidBuf(v));
    case 'binary': return types.wrap_binary(Buffer.from(v, 'hex'));
    case 'string': return types.wrap_string(v);
    case 'symbol': return types.wrap_symbol(v);
    case 'list': return v.length ? types.List32(v.map(fromCanonical)) : types.List0();
    case 'map': return types.Map32([].concat(...v.map(([k, x]) => [fromCanonical(k), fromCanonical(x)])));
    case 'array': {
        const code = TYPECODES[c.element];
        if (code === undefined) throw new Error('no array element type ' + c.element);
        return types.Array32(v.map((e) => rawValue(c.element, e.value)), code);
    }
    default: throw new Error('unknown canonical type ' + t);
    }
}

function toCanonical(typed) {
    const code = typed.type.typecode;
    const name = NAMES_BY_CODE[code];
    const v = typed.value;
    switch (name) {
    case 'null': return {type: 'null'};
    case 'boolean': return {type: name, value: code === 0x41 ? true : code === 0x42 ? false : Boolean(v)};
    case 'ubyte': case 'ushort': case 'uint': case 'byte': case 'short': case 'int':
    case 'float': case 'double':
        return {type: name, value: v === undefined || v === null ? 0 : Number(v)};
    case 'ulong':
        return {type: name, value: Buffer.isBuffer(v) ? v.readBigUInt64BE().toString() : String(v || 0)};
    case 'long':
        return {type: name, value: Buffer.isBuffer(v) ? v.readBigInt64BE().toString() : String(v)};
    case 'decimal32': case 'decimal64': case 'decimal128': case 'binary':
        return {type: name, value: Buffer.from(v).toString('hex')};
    case 'char': return {type: name, value: String.fromCodePoint(v)};
    case 'timestamp': return {type: name, value: v instanceof Date ? v.getTime() : Number(v)};
    case 'uuid': return {type: name, value: uuidStr(v)};
    case 'string': case 'symbol': return {type: name, value: String(v)};
    case 'list': return {type: name, value: (v || []).map(toCanonical)};
    case 'map': {
        const pairs = [];
        for (let i = 0; i + 1 < v.length; i += 2) pairs.push([toCanonical(v[i]), toCanonical(v[i + 1])]);
        return {type: name, value: pairs};
    }
    case 'array': {
        const etype = types.by_code[typed.array_constructor.typecode];
        return {type: 'array', element: NAMES_BY_CODE[etype.typecode] || 'code-' + etype.typecode,
            value: v.map(toCanonical)};
    }
    default: return {type: 'unknown:0x' + code.toString(16), value: String(v)};
    }
}

function prune(c, excluded) {
    if (excluded.has(c.type)) return null;
    if (c.type === 'list') return {type: 'list', value: c.value.map((x) => prune(x, excluded)).filter((x) => x)};
    if (c.type === 'map') {
        const out = [];
        for (const [k, x] of c.value) {
            const pk = prune(k, excluded), px = prune(x, excluded);
            if (pk && px) out.push([pk, px]);
        }
        return {type: 'map', value: out};
    }
    if (c.type === 'array' && excluded.has(c.element)) return null;
    return c;
}

function loadExpected(file, excluded) {
    const doc = JSON.parse(fs.readFileSync(file, 'utf8'));
    const props = {};
    for (const [k, v] of Object.entries(doc.application_properties)) {
        const p = prune(v, excluded);
        if (p) props[k] = p;
    }
    return {props, body: prune(doc.body, excluded)};
}

function isObj(x) { return x !== null && typeof x === 'object' && !Array.isArray(x); }

// Structural comparison of canonical values; maps compare in any order.
function canonEqual(a, b, where, diffs) {
    if (isObj(a) && isObj(b) && a.type === 'map' && b.type === 'map') {
        const ea = a.value || [], unmatched = [...(b.value || [])];
        if (ea.length !== unmatched.length) diffs.push(`${where}: map of ${ea.length} entries expected, got ${unmatched.length}`);
        for (const [k, x] of ea) {
            const i = unmatched.findIndex(([k2]) => { const d = []; canonEqual(k, k2, '', d); return d.length === 0; });
            if (i < 0) { diffs.push(`${where}: key ${JSON.stringify(k)} missing`); continue; }
            canonEqual(x, unmatched.splice(i, 1)[0][1], `${where}[${JSON.stringify(k.value)}]`, diffs);
        }
        for (const [k] of unmatched) diffs.push(`${where}: unexpected key ${JSON.stringify(k)}`);
        return;
    }
    if (isObj(a) && isObj(b)) {
        for (const key of [...new Set([...Object.keys(a), ...Object.keys(b)])].sort()) {
            canonEqual(a[key], b[key], key === 'value' ? where : `${where}.${key}`, diffs);
        }
        return;
    }
    if (Array.isArray(a) && Array.isArray(b)) {
        if (a.length !== b.length) diffs.push(`${where}: ${a.length} elements expected, got ${b.length}`);
        for (let i = 0; i < Math.min(a.length, b.length); i++) canonEqual(a[i], b[i], `${where}[${i}]`, diffs);
        return;
    }
    if (a !== b) diffs.push(`${where}: expected ${JSON.stringify(a)}, got ${JSON.stringify(b)}`);
}

// rhea reads a long/ulong beyond 2^53 whose high word is below 2^21 as a (rounded)
// JavaScript number; for the comparison keep the 8 bytes of every long/ulong instead.
function withExactLongs(fn) {
    const saved = [0x80, 0x81].map((c) => [c, types.by_code[c].read]);
    for (const [c] of saved) types.by_code[c].read = (buffer, offset) => Buffer.from(buffer.slice(offset, offset + 8));
    try { return fn(); } finally { for (const [c, read] of saved) types.by_code[c].read = read; }
}

// Decode the raw message with rhea's typed Reader: application-properties and body.
function typedSections(raw) {
    return withExactLongs(() => typedSectionsExact(raw));
}

function typedSectionsExact(raw) {
    const reader = new types.Reader(raw);
    const out = {props: {}, body: null};
    while (reader.remaining()) {
        const s = reader.read();
        const d = s.descriptor ? Number(s.descriptor.value) : null;
        if (d === 0x74) {
            const items = s.value || [];
            for (let i = 0; i + 1 < items.length; i += 2) out.props[String(items[i].value)] = toCanonical(items[i + 1]);
        } else if (d === 0x77) {
            // the section's own descriptor was put on the value object by the reader
            const copy = Object.assign(Object.create(Object.getPrototypeOf(s)), s);
            delete copy.descriptor;
            out.body = toCanonical(copy);
        }
    }
    return out;
}

// ------------------------------------------------------------------ scenarios

function parseUrl(url) {
    const u = new URL(url);
    const opts = {host: u.hostname, port: Number(u.port || 5672), reconnect: false};
    if (u.username) { opts.username = decodeURIComponent(u.username); opts.password = decodeURIComponent(u.password); }
    return opts;
}

function conditionText(err) {
    if (!err) return null;
    return err.description ? `${err.condition}: ${err.description}` : String(err.condition || err);
}

function isNullSource(link) {
    const s = link.remote && link.remote.attach ? link.remote.attach.source : null;
    return !s || (s.address === undefined || s.address === null) && !s.dynamic && !(s.capabilities && s.capabilities.length);
}

class Scenario {
    constructor(args) {
        this.args = args;
        this.result = null;
        this.t0 = Date.now();
        this.container = rhea.create_container({id: args['container-id']});
        this.finished = new Promise((resolve) => { this.resolve = resolve; });
    }

    start() {
        this.timer = setTimeout(() => this.fail(`timed out after ${this.args.timeout}s: ${this.progress()}`),
            this.args.timeout * 1000);
        const c = this.container;
        c.on('error', (e) => this.fail(`error: ${e && e.message ? e.message : e}`));
        c.on('connection_error', (ctx) => this.fail(`connection closed by the broker: ${conditionText(ctx.connection.error)}`));
        c.on('disconnected', (ctx) => { if (!this.result) this.fail(`disconnected: ${ctx.error ? ctx.error.message || ctx.error : 'socket closed'}`); });
        c.on('rejected', (ctx) => this.fail(`message rejected: ${conditionText(ctx.delivery.remote_state && ctx.delivery.remote_state.error)}`));
        c.on('released', () => this.fail('message released by the broker'));
        for (const ev of ['receiver_error', 'sender_error']) {
            c.on(ev, (ctx) => this.onLinkError(ctx, ctx.receiver || ctx.sender));
        }
        this.conn = c.connect(parseUrl(this.args.url));
        try {
            this.begin();
        } catch (e) {
            this.fail(`${e.name}: ${e.message}`);
        }
        return this.finished;
    }

    onLinkError(ctx, link) {
        this.fail(`link '${link.name}' detached by the broker: ${conditionText(link.error || (link.remote.detach && link.remote.detach.error))}`);
    }

    progress() { return 'no progress report'; }

    done(details) { this.finish(Object.assign({result: 'pass'}, details || {})); }

    fail(reason, details) { this.finish(Object.assign({result: 'fail', error: reason}, details || {})); }

    finish(result) {
        if (this.result) return;
        this.result = result;
        clearTimeout(this.timer);
        try {
            if (this.conn && this.conn.is_open()) this.conn.close();
        } catch (e) { /* closing anyway */ }
        // give the close frame a moment, then end regardless
        setTimeout(() => this.resolve(), this.conn && this.conn.is_open() ? 200 : 50);
        if (this.conn) this.conn.once('connection_close', () => this.resolve());
    }
}

function seqMessage(i, extra) {
    return {body: `msg-${i}`, application_properties: Object.assign({seq: i}, extra || {}), durable: true};
}

class Sender extends Scenario {
    begin() {
        this.sent = this.accepted = 0;
        this.sender = this.conn.open_sender(this.args.address);
        this.container.on('sendable', (ctx) => {
            while (ctx.sender.sendable() && this.sent < this.args.count) {
                ctx.sender.send(seqMessage(this.sent));
                this.sent++;
            }
        });
        this.container.on('accepted', () => {
            if (++this.accepted === this.args.count) this.done({sent: this.sent, accepted: this.accepted});
        });
    }

    progress() { return `sent ${this.sent}, accepted ${this.accepted} of ${this.args.count}`; }
}

class Receiver extends Scenario {
    begin() {
        this.got = [];
        const opts = {source: this.args.address, credit_window: 100};
        if (this.args['link-name']) opts.name = this.args['link-name'];
        this.conn.open_receiver(opts);
        this.container.on('receiver_open', (ctx) => {
            if (isNullSource(ctx.receiver)) return this.fail('attach refused (null source)');
            emit({event: 'ready'});
        });
        this.container.on('message', (ctx) => {
            this.got.push(Number(ctx.message.application_properties.seq));
            if (this.got.length === this.args.count) {
                const first = this.got.findIndex((s, i) => s !== i);
                if (first < 0) this.done({received: this.got.length, in_order: true});
                else this.fail(`order broken at position ${first}: got seq ${this.got[first]}`, {received: this.got.length, in_order: false});
            }
        });
    }

    progress() { return `received ${this.got.length} of ${this.args.count}`; }
}

function jmsSharedDurableSource(address, global) {
    return {
        address, durable: 2, expiry_policy: 'never', distribution_mode: 'copy',
        capabilities: ['topic', 'shared'].concat(global ? ['global'] : []),
    };
}

class GlobalSharedReceiver extends Scenario {
    begin() {
        this.got = [];
        this.last = null;
        this.receiver = this.conn.open_receiver({
            name: `${this.args.sub}|global`, source: jmsSharedDurableSource(this.args.address, true), credit_window: 100,
        });
        this.container.on('receiver_open', (ctx) => {
            if (isNullSource(ctx.receiver)) return this.fail('shared subscription attach refused (null source)');
            emit({event: 'ready'});
            this.tick = setInterval(() => {
                if (this.last !== null && Date.now() - this.last >= this.args.idle * 1000) {
                    clearInterval(this.tick);
                    this.receiver.detach();
                }
            }, 100);
        });
        this.container.on('message', (ctx) => {
            this.got.push(Number(ctx.message.application_properties.seq));
            this.last = Date.now();
        });
        this.container.on('receiver_close', (ctx) => {
            if (ctx.receiver.error) return this.onLinkError(ctx, ctx.receiver);
            this.done({received: this.got});
        });
    }

    finish(result) { clearInterval(this.tick); super.finish(result); }

    progress() { return `received ${this.got.length}`; }
}

class ClientIdSharedReceiver extends Scenario {
    begin() {
        this.perLink = {};
        this.opened = this.detached = 0;
        this.links = [];
        for (const name of [this.args.sub, `${this.args.sub}|2`]) {
            this.perLink[name] = [];
            this.links.push(this.conn.open_receiver({
                name, source: jmsSharedDurableSource(this.args.address, false), credit_window: 100,
            }));
        }
        this.container.on('receiver_open', (ctx) => {
            if (isNullSource(ctx.receiver)) return this.fail(`attach of '${ctx.receiver.name}' refused (null source)`);
            if (++this.opened === 2) emit({event: 'ready'});
        });
        this.container.on('message', (ctx) => {
            this.perLink[ctx.receiver.name].push(Number(ctx.message.application_properties.seq));
            const total = Object.values(this.perLink).reduce((n, v) => n + v.length, 0);
            if (total === this.args.count) {
                const merged = [].concat(...Object.values(this.perLink)).sort((a, b) => a - b);
                const counts = Object.fromEntries(Object.entries(this.perLink).map(([k, v]) => [k, v.length]));
                this.counts = counts;
                if (merged.some((s, i) => s !== i)) return this.fail('the two links together did not get each message exactly once', {per_link: counts});
                if (Math.min(...Object.values(counts)) === 0) return this.fail('messages did not split: one link got none', {per_link: counts});
                for (const l of this.links) l.detach();
            }
        });
        this.container.on('receiver_close', (ctx) => {
            if (ctx.receiver.error) return this.onLinkError(ctx, ctx.receiver);
            if (++this.detached === this.links.length) this.done({per_link: this.counts});
        });
    }

    progress() { return 'received ' + JSON.stringify(Object.values(this.perLink).map((v) => v.length)); }
}

class Unsubscribe extends Scenario {
    begin() {
        this.steps = [];
        this.variants = [[this.args.sub, false], [`${this.args.sub}g|global`, true]];
        this.container.on('receiver_open', (ctx) => this.opened(ctx.receiver));
        this.container.on('receiver_close', (ctx) => this.ended(ctx.receiver));
        this.nextVariant();
    }

    onLinkError() { /* receiver_close handles refusals */ }

    nextVariant() {
        if (!this.variants.length) return this.done({steps: this.steps});
        [this.name, this.global] = this.variants.shift();
        this.setStep('create');
        this.conn.open_receiver({name: this.name, source: jmsSharedDurableSource(this.args.address, this.global), credit_window: 0});
    }

    setStep(s) { this.step = s; this.steps.push(`${this.name}:${s}`); }

    lookup() {
        // null source, empty target: what Qpid JMS sends before an unsubscribe.  rhea keys
        // a session's links by name and removes a detached link on a later tick, so a new
        // link of the same name must wait until the old one is gone.
        setImmediate(() => this.conn.open_receiver({name: this.name, credit_window: 0}));
    }

    opened(link) {
        const isNull = isNullSource(link);
        if (this.step === 'create') {
            if (isNull) return this.fail(`${this.name}: subscribe refused`);
            this.setStep('detach-keep');
            link.detach();
        } else if (this.step === 'lookup') {
            if (isNull) return this.fail(`${this.name}: null-source lookup of an existing subscription answered with a null source`);
            this.setStep('unsubscribe');
            link.close();
        } else if (this.step === 'lookup-gone') {
            if (!isNull) this.fail(`${this.name}: null-source lookup after unsubscribe answered with a source; expected a refusal`);
        }
    }

    ended(link) {
        const err = link.remote.detach ? link.remote.detach.error : null;
        if (this.step === 'detach-keep') {
            if (err) return this.fail(`${this.name}: detach closed=false answered with ${conditionText(err)}`);
            this.setStep('lookup');
            this.lookup();
        } else if (this.step === 'unsubscribe') {
            if (err) return this.fail(`${this.name}: unsubscribe (detach closed=true) answered with ${conditionText(err)}`);
            this.setStep('lookup-gone');
            this.lookup();
        } else if (this.step === 'lookup-gone') {
            if (!err || err.condition !== 'amqp:not-found') return this.fail(`${this.name}: lookup after unsubscribe: expected amqp:not-found, got ${conditionText(err)}`);
            this.nextVariant();
        } else {
            this.fail(`${this.name}: unexpected detach at step ${this.step}: ${conditionText(err)}`);
        }
    }

    progress() { return `at step ${this.step}`; }
}

class Selector extends Scenario {
    begin() {
        this.got = [];
        this.conn.open_receiver({
            name: 'selector-' + crypto.randomUUID(), credit_window: 100,
            source: {
                address: this.args.address, capabilities: ['topic'], expiry_policy: 'link-detach',
                filter: {'jms-selector': types.wrap_described("color = 'red'", SELECTOR_DESCRIPTOR)},
            },
        });
        this.toSend = [];
        for (let i = 0; i < 10; i++) this.toSend.push([`m${i}`, i % 2 === 0 ? 'red' : 'blue']);
        this.toSend.push(['end', 'red']);
        this.container.on('receiver_open', (ctx) => {
            const src = ctx.receiver.remote.attach.source;
            if (isNullSource(ctx.receiver)) return this.fail('selector consumer refused (null source)');
            if (!src.filter || !('jms-selector' in src.filter)) return this.fail(`the broker did not echo the jms-selector filter: ${JSON.stringify(src.filter)}`);
            const addr = this.args.address.includes('/') ? this.args.address : 'amq.topic/' + this.args.address;
            this.conn.open_sender(addr);
        });
        this.container.on('sendable', (ctx) => {
            while (ctx.sender.sendable() && this.toSend.length) {
                const [body, color] = this.toSend.shift();
                ctx.sender.send({body, application_properties: {color}});
            }
        });
        this.container.on('message', (ctx) => {
            this.got.push(ctx.message.body);
            if (ctx.message.body === 'end') {
                const expected = ['m0', 'm2', 'm4', 'm6', 'm8', 'end'];
                if (JSON.stringify(this.got) === JSON.stringify(expected)) this.done({received: this.got});
                else this.fail(`expected ${JSON.stringify(expected)}, got ${JSON.stringify(this.got)}`);
            }
        });
    }

    progress() { return 'received ' + JSON.stringify(this.got); }
}

class Large extends Scenario {
    begin() {
        const n = this.args.size;
        this.payload = Buffer.alloc(n);
        for (let i = 0; i < n; i++) this.payload[i] = (i * 31 + 7) & 0xff;
        this.digest = crypto.createHash('sha256').update(this.payload).digest('hex');
        this.sent = false;
        this.conn.open_sender(this.args.address);
        this.container.on('sendable', (ctx) => {
            if (this.sent) return;
            this.sent = true;
            this.tSend = Date.now();
            ctx.sender.send({body: rheaMessage.data_section(this.payload), application_properties: {sha256: this.digest}});
        });
        this.container.on('accepted', () => this.conn.open_receiver({source: this.args.address, credit_window: 10}));
        this.container.on('message', (ctx) => {
            let body = ctx.message.body;
            if (body && body.typecode === 0x75) body = body.content;
            if (!Buffer.isBuffer(body)) return this.fail(`body came back as ${typeof body}`);
            if (!body.equals(this.payload)) return this.fail(`body differs: ${body.length} bytes`);
            this.done({size: body.length, sha256: this.digest, round_trip_ms: Date.now() - this.tSend});
        });
    }
}

class Drain extends Scenario {
    begin() {
        this.PROMPT = 1000;
        this.phase = 'attach';
        this.got = [];
        this.timings = {};
        this.accepted = 0;
        this.receiver = this.conn.open_receiver({source: this.args.address, credit_window: 0});
        this.container.on('receiver_open', () => {
            this.phase = 'drain-empty';
            this.t = Date.now();
            this.receiver.drain = true;
            this.receiver.add_credit(10);
        });
        this.container.on('receiver_drained', (ctx) => {
            const took = Date.now() - this.t;
            ctx.receiver.drain = false;
            if (this.phase === 'drain-empty') {
                this.timings.empty_drain_ms = took;
                if (ctx.receiver.credit !== 0) return this.fail(`drain answered with credit ${ctx.receiver.credit}`);
                if (took > this.PROMPT) return this.fail(`empty drain answered after ${took} ms`);
                this.phase = 'send';
                this.sent = 0;
                this.conn.open_sender(this.args.address);
            } else if (this.phase === 'drain-3') {
                this.timings.drain_3_ms = took;
                if (JSON.stringify(this.got) !== '["d0","d1","d2"]') return this.fail(`drain with 3 available: credit 0 after ${JSON.stringify(this.got)}, expected d0..d2`);
                if (took > this.PROMPT) return this.fail(`second drain answered after ${took} ms`);
                this.done(this.timings);
            }
        });
        this.container.on('sendable', (ctx) => {
            while (this.phase === 'send' && ctx.sender.sendable() && this.sent < 3) ctx.sender.send({body: `d${this.sent++}`});
        });
        this.container.on('accepted', () => {
            if (++this.accepted === 3) {
                this.phase = 'drain-3';
                this.t = Date.now();
                this.receiver.drain = true;
                this.receiver.add_credit(10);
            }
        });
        this.container.on('message', (ctx) => this.got.push(ctx.message.body));
    }

    progress() { return `phase ${this.phase}, received ${JSON.stringify(this.got)}`; }
}

// Receive one and close, five times (JmsTemplate.receive()): each round opens a receiver
// with a prefetch of 10 on a queue of 5 messages, accepts the first message and closes
// the receiver with the rest unsettled.  A normal close is not a failed delivery
// attempt: every round must get the next message with delivery-count 0.
class ConsumerClose extends Scenario {
    begin() {
        this.ROUNDS = 5;
        this.phase = 'send';
        this.sent = this.accepted = 0;
        this.got = [];
        this.conn.open_sender(this.args.address);
        this.container.on('sendable', (ctx) => {
            while (this.phase === 'send' && ctx.sender.sendable() && this.sent < this.ROUNDS) {
                ctx.sender.send({body: `c${this.sent++}`});
            }
        });
        this.container.on('accepted', () => {
            if (this.phase === 'send' && ++this.accepted === this.ROUNDS) {
                this.phase = 'rounds';
                this.openRound();
            }
        });
        this.container.on('message', (ctx) => {
            if (ctx.receiver !== this.receiver || this.taken) return;   // the prefetched rest stays unsettled
            this.taken = true;
            this.got.push([ctx.message.body, ctx.message.delivery_count || 0]);
            ctx.delivery.accept();
            ctx.receiver.close();
        });
        this.container.on('receiver_close', (ctx) => {
            if (ctx.receiver !== this.receiver || this.phase !== 'rounds') return;
            if (this.got.length < this.ROUNDS) return this.openRound();
            const expected = [...Array(this.ROUNDS).keys()].map((i) => [`c${i}`, 0]);
            if (JSON.stringify(this.got) !== JSON.stringify(expected)) {
                return this.fail(`rounds got ${JSON.stringify(this.got)}, expected ${JSON.stringify(expected)}`);
            }
            this.done({rounds: this.got});
        });
    }

    openRound() {
        this.taken = false;
        this.receiver = this.conn.open_receiver({source: this.args.address, credit_window: 10, autoaccept: false});
    }

    progress() { return `phase ${this.phase}, rounds ${JSON.stringify(this.got)}`; }
}

class TypesSender extends Scenario {
    begin() {
        const {props, body} = loadExpected(this.args['types-file'], this.args.excluded);
        const ap = {};
        for (const [k, v] of Object.entries(props)) ap[k] = fromCanonical(v);
        this.msg = {application_properties: ap, body: fromCanonical(body)};
        this.sent = false;
        this.conn.open_sender(this.args.address);
        this.container.on('sendable', (ctx) => {
            if (!this.sent) { this.sent = true; ctx.sender.send(this.msg); }
        });
        this.container.on('accepted', () => this.done());
    }
}

class TypesReceiver extends Scenario {
    begin() {
        this.expected = loadExpected(this.args['types-file'], this.args.excluded);
        this.conn.open_receiver({source: this.args.address, credit_window: 1});
        this.container.on('message', (ctx) => {
            const got = typedSections(ctx.message.__raw);
            const diffs = [];
            canonEqual(this.expected.props, got.props, 'application_properties', diffs);
            canonEqual(this.expected.body, got.body, 'body', diffs);
            if (diffs.length) this.fail(`${diffs.length} difference(s): ${diffs.slice(0, 8).join('; ')}`, {differences: diffs});
            else this.done({properties: Object.keys(got.props).length, body_entries: (got.body.value || []).length});
        });
    }
}

const ROLES = {
    'queue/sender': Sender, 'queue/receiver': Receiver,
    'topic/sender': Sender, 'topic/receiver': Receiver,
    'shared-global/sender': Sender, 'shared-global/receiver': GlobalSharedReceiver,
    'shared-clientid/sender': Sender, 'shared-clientid/receiver': ClientIdSharedReceiver,
    'unsubscribe/run': Unsubscribe,
    'selector/run': Selector,
    'large/run': Large,
    'drain/run': Drain,
    'consumer-close/run': ConsumerClose,
    'types/sender': TypesSender, 'types/receiver': TypesReceiver,
};

async function main() {
    let args;
    try {
        args = parseArgs(process.argv.slice(2));
    } catch (e) {
        emit({client: CLIENT, result: 'fail', error: e.message});
        return 2;
    }
    const base = {client: CLIENT, scenario: args.scenario, role: args.role};
    if (args.scenario === 'info') {
        emit(Object.assign(base, {
            result: 'pass', library: 'rhea', version: RHEA_VERSION, unsupported_types: [],
            transactions: false, transactions_note: 'rhea has no transaction API (no coordinator/declare/discharge support)',
            roles: Object.keys(ROLES).sort(),
        }));
        return 0;
    }
    const Cls = ROLES[`${args.scenario}/${args.role}`];
    if (!Cls) {
        if (args.scenario === 'transaction') {
            emit(Object.assign(base, {result: 'unsupported', error: 'rhea has no transaction API'}));
            return 3;
        }
        emit(Object.assign(base, {result: 'fail', error: `unknown scenario/role ${args.scenario}/${args.role}`}));
        return 2;
    }
    const s = new Cls(args);
    await s.start();
    const result = Object.assign(base, s.result, {elapsed_ms: Date.now() - s.t0});
    emit(result);
    return result.result === 'pass' ? 0 : 1;
}

main().then((code) => process.exit(code), (e) => {
    emit({client: CLIENT, result: 'fail', error: `${e.name}: ${e.message}`});
    process.exit(1);
});
