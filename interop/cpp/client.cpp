// Qpid Proton C++ client for the amqpbroker interop scenarios (see interop/README.md).
//
//   interop-client --url amqp://127.0.0.1:5672 --scenario NAME --role ROLE [options]
//
// Prints JSON lines on stdout: progress events ({"event": "ready"} once its links are
// attached) and, last, one result line {"result": "pass"|"fail", "error": ..., ...}.
// Exit status 0 on pass, 1 on fail, 2 on bad usage, 3 when the library lacks the feature.

#include <proton/binary.hpp>
#include <proton/codec/decoder.hpp>
#include <proton/codec/encoder.hpp>
#include <proton/connection.hpp>
#include <proton/connection_options.hpp>
#include <proton/container.hpp>
#include <proton/decimal.hpp>
#include <proton/delivery.hpp>
#include <proton/error_condition.hpp>
#include <proton/codec.h>
#include <proton/link.h>
#include <proton/message.hpp>
#include <proton/messaging_handler.hpp>
#include <proton/null.hpp>
#include <proton/receiver.hpp>
#include <proton/receiver_options.hpp>
#include <proton/scalar.hpp>
#include <proton/sender.hpp>
#include <proton/sender_options.hpp>
#include <proton/source.hpp>
#include <proton/source_options.hpp>
#include <proton/symbol.hpp>
#include <proton/target_options.hpp>
#include <proton/terminus.h>
#include <proton/timestamp.hpp>
#include <proton/tracker.hpp>
#include <proton/transport.hpp>
#include <proton/types.hpp>
#include <proton/uuid.hpp>
#include <proton/value.hpp>
#include <proton/version.h>
#include <proton/work_queue.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "json.hpp"

using mini::Json;
namespace codec = proton::codec;

static const char* CLIENT = "cpp";
static const uint64_t SELECTOR_DESCRIPTOR = 0x0000468C00000004ULL;

static void emit(const Json& j) {
    std::cout << mini::dump(j) << std::endl;
}

static double now_s() {
    using namespace std::chrono;
    return duration_cast<duration<double>>(steady_clock::now().time_since_epoch()).count();
}

static std::string random_hex(int n) {
    static std::mt19937_64 rng(std::random_device{}());
    const char* digits = "0123456789abcdef";
    std::string s;
    for (int i = 0; i < n; i++) s += digits[rng() % 16];
    return s;
}

// --------------------------------------------------------------------- raw proton-c access
// proton-cpp hides the pn_link_t; the null source (the Qpid JMS unsubscribe lookup) and
// the check for a refusal (null source in the reply) need it.
struct link_access : proton::link {
    static pn_link_t* raw(const proton::link& l) {
        typedef pn_link_t* (proton::internal::object<pn_link_t>::*getter)() const;
        getter g = &link_access::pn_object;
        return (l.*g)();
    }
};

static bool remote_source_is_null(const proton::link& l) {
    pn_terminus_t* t = pn_link_remote_source(link_access::raw(l));
    if (pn_terminus_get_type(t) == PN_UNSPECIFIED) return true;
    return pn_terminus_get_address(t) == nullptr && !pn_terminus_is_dynamic(t)
           && pn_data_size(pn_terminus_capabilities(t)) == 0;
}

static void make_source_null(const proton::link& l) {
    pn_terminus_t* t = pn_link_source(link_access::raw(l));
    pn_terminus_set_type(t, PN_UNSPECIFIED);
    pn_terminus_set_address(t, nullptr);
}

static std::string condition_text(const proton::error_condition& e) {
    if (!e) return "(no error)";
    return e.description().empty() ? e.name() : e.name() + ": " + e.description();
}

// --------------------------------------------------------------------- canonical types

static std::string to_hex(const unsigned char* p, size_t n) {
    static const char* d = "0123456789abcdef";
    std::string s;
    for (size_t i = 0; i < n; i++) { s += d[p[i] >> 4]; s += d[p[i] & 15]; }
    return s;
}

static std::vector<unsigned char> from_hex(const std::string& h) {
    std::vector<unsigned char> out;
    for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back((unsigned char)std::stoul(h.substr(i, 2), nullptr, 16));
    return out;
}

template <class B> static void fill_bytes(B& b, const std::string& hex) {
    auto v = from_hex(hex);
    if (v.size() != b.size()) throw std::runtime_error("wrong byte count for " + hex);
    std::copy(v.begin(), v.end(), b.begin());
}

// proton-cpp converts decimal32/decimal64 to proton-c's uint32_t/uint64_t by copying
// the bytes (types_internal.hpp byte_copy), so their byte_array holds the *host-order*
// integer, not the wire bytes (decimal128 and uuid are byte arrays in wire order).  The
// canonical form is the wire bytes: swap on a little-endian host.
static bool little_endian() { uint16_t x = 1; return *reinterpret_cast<unsigned char*>(&x) == 1; }

template <class B> static void wire_to_proton(B& b) { if (little_endian()) std::reverse(b.begin(), b.end()); }

template <class B> static std::string proton_to_wire_hex(B b) {
    if (little_endian()) std::reverse(b.begin(), b.end());
    return to_hex(b.begin(), b.size());
}

static proton::type_id type_of(const std::string& t) {
    static const std::map<std::string, proton::type_id> m = {
        {"null", proton::NULL_TYPE}, {"boolean", proton::BOOLEAN}, {"ubyte", proton::UBYTE},
        {"ushort", proton::USHORT}, {"uint", proton::UINT}, {"ulong", proton::ULONG}, {"byte", proton::BYTE},
        {"short", proton::SHORT}, {"int", proton::INT}, {"long", proton::LONG}, {"float", proton::FLOAT},
        {"double", proton::DOUBLE}, {"decimal32", proton::DECIMAL32}, {"decimal64", proton::DECIMAL64},
        {"decimal128", proton::DECIMAL128}, {"char", proton::CHAR}, {"timestamp", proton::TIMESTAMP},
        {"uuid", proton::UUID}, {"binary", proton::BINARY}, {"string", proton::STRING},
        {"symbol", proton::SYMBOL}, {"list", proton::LIST}, {"map", proton::MAP}, {"array", proton::ARRAY}};
    auto it = m.find(t);
    if (it == m.end()) throw std::runtime_error("unknown canonical type " + t);
    return it->second;
}

static std::string name_of(proton::type_id t) {
    switch (t) {
    case proton::NULL_TYPE: return "null";
    case proton::BOOLEAN: return "boolean";
    case proton::UBYTE: return "ubyte";
    case proton::USHORT: return "ushort";
    case proton::UINT: return "uint";
    case proton::ULONG: return "ulong";
    case proton::BYTE: return "byte";
    case proton::SHORT: return "short";
    case proton::INT: return "int";
    case proton::LONG: return "long";
    case proton::FLOAT: return "float";
    case proton::DOUBLE: return "double";
    case proton::DECIMAL32: return "decimal32";
    case proton::DECIMAL64: return "decimal64";
    case proton::DECIMAL128: return "decimal128";
    case proton::CHAR: return "char";
    case proton::TIMESTAMP: return "timestamp";
    case proton::UUID: return "uuid";
    case proton::BINARY: return "binary";
    case proton::STRING: return "string";
    case proton::SYMBOL: return "symbol";
    case proton::LIST: return "list";
    case proton::MAP: return "map";
    case proton::ARRAY: return "array";
    case proton::DESCRIBED: return "described";
    default: return "unknown";
    }
}

// Encode one canonical value with proton-cpp's typed encoder.
static void put(codec::encoder& e, const Json& c) {
    const std::string& t = c["type"].str;
    const Json& v = c["value"];
    switch (type_of(t)) {
    case proton::NULL_TYPE: e << proton::null(); break;
    case proton::BOOLEAN: e << v.b; break;
    case proton::UBYTE: e << uint8_t(v.num); break;
    case proton::USHORT: e << uint16_t(v.num); break;
    case proton::UINT: e << uint32_t(v.num); break;
    case proton::ULONG: e << uint64_t(std::strtoull(v.str.c_str(), nullptr, 10)); break;
    case proton::BYTE: e << int8_t(v.num); break;
    case proton::SHORT: e << int16_t(v.num); break;
    case proton::INT: e << int32_t(v.num); break;
    case proton::LONG: e << int64_t(std::strtoll(v.str.c_str(), nullptr, 10)); break;
    case proton::FLOAT: e << float(v.num); break;
    case proton::DOUBLE: e << double(v.num); break;
    case proton::DECIMAL32: { proton::decimal32 d; fill_bytes(d, v.str); wire_to_proton(d); e << d; break; }
    case proton::DECIMAL64: { proton::decimal64 d; fill_bytes(d, v.str); wire_to_proton(d); e << d; break; }
    case proton::DECIMAL128: { proton::decimal128 d; fill_bytes(d, v.str); e << d; break; }
    case proton::CHAR: e << wchar_t(mini::first_code_point(v.str)); break;
    case proton::TIMESTAMP: e << proton::timestamp(int64_t(v.num)); break;
    case proton::UUID: {
        std::string hex;
        for (char ch : v.str) if (ch != '-') hex += ch;
        proton::uuid u;
        fill_bytes(u, hex);
        e << u;
        break;
    }
    case proton::BINARY: { auto b = from_hex(v.str); e << proton::binary(b.begin(), b.end()); break; }
    case proton::STRING: e << v.str; break;
    case proton::SYMBOL: e << proton::symbol(v.str); break;
    case proton::LIST:
        e << codec::start::list();
        for (auto& x : v.arr) put(e, x);
        e << codec::finish();
        break;
    case proton::MAP:
        e << codec::start::map();
        for (auto& kv : v.arr) { put(e, kv.arr.at(0)); put(e, kv.arr.at(1)); }
        e << codec::finish();
        break;
    case proton::ARRAY:
        e << codec::start::array(type_of(c["element"].str));
        for (auto& x : v.arr) put(e, x);
        e << codec::finish();
        break;
    default: throw std::runtime_error("cannot encode " + t);
    }
}

static Json T(const std::string& type, Json value) {
    Json j = Json::object();
    j.set("type", Json::string(type));
    j.set("value", std::move(value));
    return j;
}

// Decode the next value into its canonical form.
static Json get(codec::decoder& d) {
    proton::type_id t = d.next_type();
    switch (t) {
    case proton::NULL_TYPE: {
        // decoder >> proton::null does not move past the null in 0.37: read it as a value
        proton::value n; d >> n;
        Json j = Json::object(); j.set("type", Json::string("null")); return j;
    }
    case proton::BOOLEAN: { bool x; d >> x; return T("boolean", Json::boolean(x)); }
    case proton::UBYTE: { uint8_t x; d >> x; return T("ubyte", Json::number(x)); }
    case proton::USHORT: { uint16_t x; d >> x; return T("ushort", Json::number(x)); }
    case proton::UINT: { uint32_t x; d >> x; return T("uint", Json::number(x)); }
    case proton::ULONG: { uint64_t x; d >> x; return T("ulong", Json::string(std::to_string(x))); }
    case proton::BYTE: { int8_t x; d >> x; return T("byte", Json::number(x)); }
    case proton::SHORT: { int16_t x; d >> x; return T("short", Json::number(x)); }
    case proton::INT: { int32_t x; d >> x; return T("int", Json::number(x)); }
    case proton::LONG: { int64_t x; d >> x; return T("long", Json::string(std::to_string(x))); }
    case proton::FLOAT: { float x; d >> x; return T("float", Json::number(x)); }
    case proton::DOUBLE: { double x; d >> x; return T("double", Json::number(x)); }
    case proton::DECIMAL32: { proton::decimal32 x; d >> x; return T("decimal32", Json::string(proton_to_wire_hex(x))); }
    case proton::DECIMAL64: { proton::decimal64 x; d >> x; return T("decimal64", Json::string(proton_to_wire_hex(x))); }
    case proton::DECIMAL128: { proton::decimal128 x; d >> x; return T("decimal128", Json::string(to_hex(x.begin(), x.size()))); }
    case proton::CHAR: { wchar_t x; d >> x; std::string s; mini::put_utf8(s, uint32_t(x)); return T("char", Json::string(s)); }
    case proton::TIMESTAMP: { proton::timestamp x; d >> x; return T("timestamp", Json::number(double(x.milliseconds()))); }
    case proton::UUID: { proton::uuid x; d >> x; return T("uuid", Json::string(x.str())); }
    case proton::BINARY: {
        proton::binary x; d >> x;
        return T("binary", Json::string(to_hex(reinterpret_cast<const unsigned char*>(x.data()), x.size())));
    }
    case proton::STRING: { std::string x; d >> x; return T("string", Json::string(x)); }
    case proton::SYMBOL: { proton::symbol x; d >> x; return T("symbol", Json::string(x)); }
    case proton::LIST: {
        codec::start s; d >> s;
        Json items = Json::array();
        for (size_t i = 0; i < s.size; i++) items.push(get(d));
        d >> codec::finish();
        return T("list", items);
    }
    case proton::MAP: {
        codec::start s; d >> s;
        Json pairs = Json::array();
        for (size_t i = 0; i + 1 < s.size + 1 && i < s.size; i += 2) {
            Json kv = Json::array();
            kv.push(get(d));
            kv.push(get(d));
            pairs.push(kv);
        }
        d >> codec::finish();
        return T("map", pairs);
    }
    case proton::ARRAY: {
        codec::start s; d >> s;
        Json items = Json::array();
        for (size_t i = 0; i < s.size; i++) items.push(get(d));
        d >> codec::finish();
        Json j = T("array", items);
        j.set("element", Json::string(name_of(s.element)));
        return j;
    }
    default: {
        proton::value skip; d >> skip;
        return T("unsupported:" + name_of(t), Json::null());
    }
    }
}

static Json prune(const Json& c, const std::set<std::string>& excluded, bool& keep) {
    const std::string& t = c["type"].str;
    keep = true;
    if (excluded.count(t)) { keep = false; return Json(); }
    if (t == "list") {
        Json items = Json::array();
        for (auto& x : c["value"].arr) { bool k; Json p = prune(x, excluded, k); if (k) items.push(p); }
        return T("list", items);
    }
    if (t == "map") {
        Json pairs = Json::array();
        for (auto& kv : c["value"].arr) {
            bool k1, k2;
            Json pk = prune(kv.arr.at(0), excluded, k1), pv = prune(kv.arr.at(1), excluded, k2);
            if (k1 && k2) { Json p = Json::array(); p.push(pk); p.push(pv); pairs.push(p); }
        }
        return T("map", pairs);
    }
    if (t == "array" && excluded.count(c["element"].str)) { keep = false; return Json(); }
    return c;
}

// Structural comparison; maps compare in any order.
static void canon_equal(const Json& a, const Json& b, const std::string& where, std::vector<std::string>& diffs) {
    if (a.kind == Json::OBJECT && b.kind == Json::OBJECT && a["type"].str == "map" && b["type"].str == "map") {
        const auto& ea = a["value"].arr;
        std::vector<Json> unmatched = b["value"].arr;
        if (ea.size() != unmatched.size())
            diffs.push_back(where + ": map of " + std::to_string(ea.size()) + " entries expected, got " + std::to_string(unmatched.size()));
        for (auto& kv : ea) {
            auto it = std::find_if(unmatched.begin(), unmatched.end(), [&](const Json& x) {
                std::vector<std::string> d; canon_equal(kv.arr.at(0), x.arr.at(0), "", d); return d.empty(); });
            if (it == unmatched.end()) { diffs.push_back(where + ": key " + mini::dump(kv.arr.at(0)) + " missing"); continue; }
            canon_equal(kv.arr.at(1), it->arr.at(1), where + "[" + mini::dump(kv.arr.at(0)["value"]) + "]", diffs);
            unmatched.erase(it);
        }
        for (auto& x : unmatched) diffs.push_back(where + ": unexpected key " + mini::dump(x.arr.at(0)));
        return;
    }
    if (a.kind == Json::OBJECT && b.kind == Json::OBJECT) {
        std::set<std::string> keys;
        for (auto& p : a.obj) keys.insert(p.first);
        for (auto& p : b.obj) keys.insert(p.first);
        for (auto& k : keys) canon_equal(a[k], b[k], k == "value" ? where : where + "." + k, diffs);
        return;
    }
    if (a.kind == Json::ARRAY && b.kind == Json::ARRAY) {
        if (a.arr.size() != b.arr.size())
            diffs.push_back(where + ": " + std::to_string(a.arr.size()) + " elements expected, got " + std::to_string(b.arr.size()));
        for (size_t i = 0; i < std::min(a.arr.size(), b.arr.size()); i++)
            canon_equal(a.arr[i], b.arr[i], where + "[" + std::to_string(i) + "]", diffs);
        return;
    }
    bool same = a.kind == b.kind && (a.kind == Json::NUL || (a.kind == Json::BOOL && a.b == b.b) ||
                                     (a.kind == Json::NUMBER && a.num == b.num) ||
                                     (a.kind == Json::STRING && a.str == b.str));
    if (!same) diffs.push_back(where + ": expected " + mini::dump(a) + ", got " + mini::dump(b));
}

struct Expected {
    Json props = Json::object();   // key -> canonical
    Json body;
};

static Expected load_expected(const std::string& file, const std::set<std::string>& excluded) {
    std::ifstream in(file);
    if (!in) throw std::runtime_error("cannot read " + file);
    std::stringstream ss;
    ss << in.rdbuf();
    Json doc = mini::parse(ss.str());
    Expected e;
    for (auto& kv : doc["application_properties"].obj) {
        bool keep;
        Json p = prune(kv.second, excluded, keep);
        if (keep) e.props.set(kv.first, p);
    }
    bool keep;
    e.body = prune(doc["body"], excluded, keep);
    return e;
}

// --------------------------------------------------------------------- options

struct Args {
    std::string url = "amqp://127.0.0.1:5672", scenario, role = "run", address = "interop.queue";
    int count = 1000;
    size_t size = 1024 * 1024;
    std::string sub = "interop-sub", container_id = "interop-cpp-" + random_hex(16), link_name;
    double idle = 1.5, timeout = 30;
    std::string types_file, exclude_types;
    std::set<std::string> excluded;
};

// --------------------------------------------------------------------- scenario base

class Scenario : public proton::messaging_handler {
  public:
    explicit Scenario(const Args& a) : args(a), t0(now_s()) {}
    virtual ~Scenario() {}

    Args args;
    Json result;
    bool finished = false, stopped = false;
    double t0, close_deadline = 0;
    proton::container* cont = nullptr;
    proton::connection conn;

    virtual void begin() = 0;
    virtual std::string progress() { return "no progress report"; }

    void on_container_start(proton::container& c) override {
        cont = &c;
        conn = c.connect(args.url, proton::connection_options().idle_timeout(proton::duration(60000)));
        watchdog();
    }

    void on_connection_open(proton::connection& c) override {
        if (began) return;
        began = true;
        try {
            begin();
        } catch (const std::exception& e) {
            fail(std::string("exception: ") + e.what());
        }
    }

    // A short periodic check rather than one timer at the deadline: proton-cpp 0.37's
    // container::run() does not return after stop() while a scheduled task is pending.
    // Timers go through the connection's work queue: work scheduled on the container
    // does not wake the connection, so frames it causes (a detach) would wait for the
    // next heartbeat.
    void later(int ms, std::function<void()> fn) { conn.work_queue().schedule(proton::duration(ms), fn); }
    void watchdog() {
        if (stopped) return;
        if (finished) {
            if (now_s() > close_deadline) return stop_now();
        } else if (now_s() - t0 > args.timeout) {
            fail("timed out after " + mini::Json::number(args.timeout).str + "s: " + progress());
        }
        later(100, [this]() { watchdog(); });
    }

    void done(Json details = Json::object()) { finish(true, "", std::move(details)); }
    void fail(const std::string& why, Json details = Json::object()) { finish(false, why, std::move(details)); }

    void finish(bool ok, const std::string& why, Json details) {
        if (finished) return;
        finished = true;
        result = Json::object();
        result.set("result", Json::string(ok ? "pass" : "fail"));
        if (!ok) result.set("error", Json::string(why));
        for (auto& kv : details.obj) result.set(kv.first, kv.second);
        // Close politely (the broker sees a close frame, not an abort) and stop once it
        // has answered; the fallback is on the connection's work queue, which does not
        // keep container::run() alive once the connection is gone.
        if (conn && conn.active()) {
            conn.close();
            close_deadline = now_s() + 3.0;   // the watchdog stops the container then at the latest
        } else {
            stop_now();
        }
    }

    void stop_now() {
        if (stopped || !cont) return;
        stopped = true;
        cont->stop();
    }

    void on_connection_close(proton::connection&) override { stop_now(); }
    void on_transport_close(proton::transport&) override { if (finished) stop_now(); }

    void on_transport_error(proton::transport& t) override { fail("transport error: " + condition_text(t.error())); }
    void on_connection_error(proton::connection& c) override { fail("connection closed by the broker: " + condition_text(c.error())); }
    void on_session_error(proton::session& s) override { fail("session ended by the broker: " + condition_text(s.error())); }
    void on_receiver_error(proton::receiver& r) override { fail("link '" + r.name() + "' detached by the broker: " + condition_text(r.error())); }
    void on_sender_error(proton::sender& s) override { fail("link '" + s.name() + "' detached by the broker: " + condition_text(s.error())); }
    void on_tracker_reject(proton::tracker&) override { fail("message rejected"); }
    void on_tracker_release(proton::tracker&) override { fail("message released by the broker"); }
    void on_error(const proton::error_condition& e) override { fail("error: " + condition_text(e)); }

  private:
    bool began = false;
};

static proton::message seq_message(int64_t i) {
    proton::message m;
    m.body("msg-" + std::to_string(i));
    m.properties().put("seq", proton::scalar(i));
    m.durable(true);
    return m;
}

static int64_t seq_of(const proton::message& m) {
    return proton::coerce<int64_t>(m.properties().get("seq"));
}

static proton::source_options jms_shared_durable(const std::string& address, bool global) {
    std::vector<proton::symbol> caps = {proton::symbol("topic"), proton::symbol("shared")};
    if (global) caps.push_back(proton::symbol("global"));
    proton::source_options so;
    so.address(address).capabilities(caps).durability_mode(proton::source::UNSETTLED_STATE)
        .expiry_policy(proton::source::NEVER).distribution_mode(proton::source::COPY);
    return so;
}

// --------------------------------------------------------------------- plain sender / receivers

class Sender : public Scenario {
  public:
    using Scenario::Scenario;
    int sent = 0, accepted = 0;
    void begin() override { conn.open_sender(args.address); }
    void on_sendable(proton::sender& s) override {
        while (s.credit() > 0 && sent < args.count) s.send(seq_message(sent++));
    }
    void on_tracker_accept(proton::tracker&) override {
        if (++accepted == args.count) {
            Json d = Json::object();
            d.set("sent", Json::number(sent));
            d.set("accepted", Json::number(accepted));
            done(d);
        }
    }
    std::string progress() override {
        return "sent " + std::to_string(sent) + ", accepted " + std::to_string(accepted) + " of " + std::to_string(args.count);
    }
};

class Receiver : public Scenario {
  public:
    using Scenario::Scenario;
    std::vector<int64_t> got;
    void begin() override {
        proton::receiver_options ro;
        ro.credit_window(100);
        if (!args.link_name.empty()) ro.name(args.link_name);
        conn.open_receiver(args.address, ro);
    }
    void on_receiver_open(proton::receiver& r) override {
        if (remote_source_is_null(r)) return fail("attach refused (null source)");
        Json ev = Json::object();
        ev.set("event", Json::string("ready"));
        emit(ev);
    }
    void on_message(proton::delivery&, proton::message& m) override {
        got.push_back(seq_of(m));
        if ((int)got.size() == args.count) {
            for (size_t i = 0; i < got.size(); i++) {
                if (got[i] != (int64_t)i) {
                    Json d = Json::object();
                    d.set("received", Json::number(got.size()));
                    d.set("in_order", Json::boolean(false));
                    return fail("order broken at position " + std::to_string(i) + ": got seq " + std::to_string(got[i]), d);
                }
            }
            Json d = Json::object();
            d.set("received", Json::number(got.size()));
            d.set("in_order", Json::boolean(true));
            done(d);
        }
    }
    std::string progress() override { return "received " + std::to_string(got.size()) + " of " + std::to_string(args.count); }
};

class GlobalSharedReceiver : public Scenario {
  public:
    using Scenario::Scenario;
    std::vector<int64_t> got;
    double last = -1;
    proton::receiver rcv;
    void begin() override {
        proton::source_options so = jms_shared_durable(args.address, true);
        rcv = conn.open_receiver(args.address, proton::receiver_options().name(args.sub + "|global").source(so).credit_window(100));
    }
    void on_receiver_open(proton::receiver& r) override {
        if (remote_source_is_null(r)) return fail("shared subscription attach refused (null source)");
        Json ev = Json::object();
        ev.set("event", Json::string("ready"));
        emit(ev);
        tick();
    }
    void tick() {
        if (finished) return;
        if (last >= 0 && now_s() - last >= args.idle) {
            rcv.detach();
            return;
        }
        later(100, [this]() { tick(); });
    }
    void on_message(proton::delivery&, proton::message& m) override {
        got.push_back(seq_of(m));
        last = now_s();
    }
    void on_receiver_detach(proton::receiver& r) override {
        if (r.error()) return on_receiver_error(r);
        Json d = Json::object();
        Json list = Json::array();
        for (auto s : got) list.push(Json::number(double(s)));
        d.set("received", list);
        done(d);
    }
    std::string progress() override { return "received " + std::to_string(got.size()); }
};

class ClientIdSharedReceiver : public Scenario {
  public:
    using Scenario::Scenario;
    std::map<std::string, std::vector<int64_t>> per_link;
    std::vector<proton::receiver> links;
    int opened = 0, detached = 0;
    Json counts = Json::object();
    void begin() override {
        for (const std::string& name : {args.sub, args.sub + "|2"}) {
            per_link[name];
            proton::source_options so = jms_shared_durable(args.address, false);
            links.push_back(conn.open_receiver(args.address, proton::receiver_options().name(name).source(so).credit_window(100)));
        }
    }
    void on_receiver_open(proton::receiver& r) override {
        if (remote_source_is_null(r)) return fail("attach of '" + r.name() + "' refused (null source)");
        if (++opened == 2) {
            Json ev = Json::object();
            ev.set("event", Json::string("ready"));
            emit(ev);
        }
    }
    void on_message(proton::delivery& dlv, proton::message& m) override {
        per_link[dlv.receiver().name()].push_back(seq_of(m));
        size_t total = 0;
        for (auto& kv : per_link) total += kv.second.size();
        if ((int)total != args.count) return;
        std::vector<int64_t> merged;
        size_t least = SIZE_MAX;
        for (auto& kv : per_link) {
            merged.insert(merged.end(), kv.second.begin(), kv.second.end());
            counts.set(kv.first, Json::number(kv.second.size()));
            least = std::min(least, kv.second.size());
        }
        std::sort(merged.begin(), merged.end());
        for (size_t i = 0; i < merged.size(); i++) {
            if (merged[i] != (int64_t)i) {
                Json d = Json::object(); d.set("per_link", counts);
                return fail("the two links together did not get each message exactly once", d);
            }
        }
        if (least == 0) {
            Json d = Json::object(); d.set("per_link", counts);
            return fail("messages did not split: one link got none", d);
        }
        for (auto& l : links) l.detach();
    }
    void on_receiver_detach(proton::receiver& r) override {
        if (r.error()) return on_receiver_error(r);
        if (++detached == (int)links.size()) {
            Json d = Json::object();
            d.set("per_link", counts);
            done(d);
        }
    }
    std::string progress() override {
        std::string s = "received";
        for (auto& kv : per_link) s += " " + std::to_string(kv.second.size());
        return s;
    }
};

// --------------------------------------------------------------------- unsubscribe

class Unsubscribe : public Scenario {
  public:
    using Scenario::Scenario;
    std::vector<std::pair<std::string, bool>> variants;
    std::string name, step;
    bool global = false;
    Json steps = Json::array();
    proton::receiver current;   // proton-cpp reports a detach with an error twice (error, close)

    void begin() override {
        variants = {{args.sub, false}, {args.sub + "g|global", true}};
        next_variant();
    }
    void set_step(const std::string& s) { step = s; steps.push(Json::string(name + ":" + s)); }
    void next_variant() {
        if (variants.empty()) {
            Json d = Json::object();
            d.set("steps", steps);
            return done(d);
        }
        name = variants.front().first;
        global = variants.front().second;
        variants.erase(variants.begin());
        set_step("create");
        proton::source_options so = jms_shared_durable(args.address, global);
        current = conn.open_receiver(args.address, proton::receiver_options().name(name).source(so).credit_window(0));
    }
    void lookup() {
        current = conn.open_receiver("", proton::receiver_options().name(name).credit_window(0));
        make_source_null(current);
    }
    void on_receiver_open(proton::receiver& r) override {
        bool null = remote_source_is_null(r);
        if (step == "create") {
            if (null) return fail(name + ": subscribe refused");
            set_step("detach-keep");
            r.detach();
        } else if (step == "lookup") {
            if (null) return fail(name + ": null-source lookup of an existing subscription answered with a null source");
            set_step("unsubscribe");
            r.close();
        } else if (step == "lookup-gone") {
            if (!null) fail(name + ": null-source lookup after unsubscribe answered with a source; expected a refusal");
        }
    }
    void on_receiver_error(proton::receiver& r) override { link_ended(r); }
    void on_receiver_close(proton::receiver& r) override { link_ended(r); }
    void on_receiver_detach(proton::receiver& r) override { link_ended(r); }

    void link_ended(proton::receiver& r) {
        if (!(r == current)) return;
        current = proton::receiver();
        proton::error_condition err = r.error();
        if (step == "detach-keep") {
            if (err) return fail(name + ": detach closed=false answered with " + condition_text(err));
            set_step("lookup");
            lookup();
        } else if (step == "unsubscribe") {
            if (err) return fail(name + ": unsubscribe (detach closed=true) answered with " + condition_text(err));
            set_step("lookup-gone");
            lookup();
        } else if (step == "lookup-gone") {
            if (!err || err.name() != "amqp:not-found")
                return fail(name + ": lookup after unsubscribe: expected amqp:not-found, got " + condition_text(err));
            next_variant();
        } else {
            fail(name + ": unexpected detach at step " + step + ": " + condition_text(err));
        }
    }
    std::string progress() override { return "at step " + step; }
};

// --------------------------------------------------------------------- selector

class Selector : public Scenario {
  public:
    using Scenario::Scenario;
    std::vector<std::string> got;
    std::vector<std::pair<std::string, std::string>> to_send;
    void begin() override {
        proton::source::filter_map filters;
        proton::value filter;
        codec::encoder enc(filter);
        enc << codec::start::described() << uint64_t(SELECTOR_DESCRIPTOR) << std::string("color = 'red'") << codec::finish();
        filters.put(proton::symbol("jms-selector"), filter);
        proton::source_options so;
        so.address(args.address).capabilities({proton::symbol("topic")}).expiry_policy(proton::source::LINK_CLOSE).filters(filters);
        conn.open_receiver(args.address, proton::receiver_options().name("selector-" + random_hex(12)).source(so).credit_window(100));
        for (int i = 0; i < 10; i++) to_send.push_back({"m" + std::to_string(i), i % 2 == 0 ? "red" : "blue"});
        to_send.push_back({"end", "red"});
    }
    void on_receiver_open(proton::receiver& r) override {
        if (remote_source_is_null(r)) return fail("selector consumer refused (null source)");
        if (!r.source().filters().exists(proton::symbol("jms-selector")))
            return fail("the broker did not echo the jms-selector filter");
        std::string addr = args.address.find('/') == std::string::npos ? "amq.topic/" + args.address : args.address;
        conn.open_sender(addr);
    }
    void on_sendable(proton::sender& s) override {
        while (s.credit() > 0 && !to_send.empty()) {
            proton::message m;
            m.body(to_send.front().first);
            m.properties().put("color", to_send.front().second);
            to_send.erase(to_send.begin());
            s.send(m);
        }
    }
    void on_message(proton::delivery&, proton::message& m) override {
        std::string body = proton::get<std::string>(m.body());
        got.push_back(body);
        if (body != "end") return;
        std::vector<std::string> expected = {"m0", "m2", "m4", "m6", "m8", "end"};
        Json list = Json::array();
        for (auto& g : got) list.push(Json::string(g));
        if (got == expected) {
            Json d = Json::object();
            d.set("received", list);
            done(d);
        } else {
            fail("expected [m0, m2, m4, m6, m8, end], got " + mini::dump(list));
        }
    }
    std::string progress() override { return "received " + std::to_string(got.size()); }
};

// --------------------------------------------------------------------- large

class Large : public Scenario {
  public:
    using Scenario::Scenario;
    proton::binary payload;
    bool sent = false;
    double t_send = 0;
    void begin() override {
        payload.resize(args.size);
        for (size_t i = 0; i < args.size; i++) payload[i] = (unsigned char)((i * 31 + 7) & 0xFF);
        conn.open_sender(args.address);
    }
    void on_sendable(proton::sender& s) override {
        if (sent) return;
        sent = true;
        t_send = now_s();
        proton::message m;
        m.body(payload);
        s.send(m);
    }
    void on_tracker_accept(proton::tracker&) override {
        conn.open_receiver(args.address, proton::receiver_options().credit_window(10));
    }
    void on_message(proton::delivery&, proton::message& m) override {
        if (m.body().type() != proton::BINARY) return fail("body came back as " + name_of(m.body().type()));
        proton::binary b = proton::get<proton::binary>(m.body());
        if (b != payload) return fail("body differs: " + std::to_string(b.size()) + " bytes");
        Json d = Json::object();
        d.set("size", Json::number(b.size()));
        d.set("round_trip_ms", Json::number(std::round((now_s() - t_send) * 1000)));
        done(d);
    }
};

// --------------------------------------------------------------------- drain

class Drain : public Scenario {
  public:
    using Scenario::Scenario;
    const double PROMPT = 1.0;
    std::string phase = "attach";
    std::vector<std::string> got;
    proton::receiver rcv;
    double t = 0;
    int sent = 0, accepted = 0;
    Json timings = Json::object();
    void begin() override {
        rcv = conn.open_receiver(args.address, proton::receiver_options().credit_window(0));
    }
    void start_drain() {
        t = now_s();
        rcv.add_credit(10);
        rcv.drain();
    }
    void on_receiver_open(proton::receiver&) override {
        phase = "drain-empty";
        start_drain();
    }
    void on_receiver_drain_finish(proton::receiver& r) override {
        double took = now_s() - t;
        if (phase == "drain-empty") {
            timings.set("empty_drain_ms", Json::number(std::round(took * 1000)));
            if (r.credit() != 0) return fail("drain answered with credit " + std::to_string(r.credit()));
            if (took > PROMPT) return fail("empty drain answered after " + std::to_string(took) + "s");
            phase = "send";
            conn.open_sender(args.address);
        } else if (phase == "drain-3") {
            timings.set("drain_3_ms", Json::number(std::round(took * 1000)));
            std::vector<std::string> expected = {"d0", "d1", "d2"};
            if (got != expected) return fail("drain with 3 available: credit 0 after " + std::to_string(got.size()) + " message(s), expected d0..d2");
            if (took > PROMPT) return fail("second drain answered after " + std::to_string(took) + "s");
            done(timings);
        }
    }
    void on_sendable(proton::sender& s) override {
        while (phase == "send" && s.credit() > 0 && sent < 3) {
            proton::message m;
            m.body("d" + std::to_string(sent++));
            s.send(m);
        }
    }
    void on_tracker_accept(proton::tracker&) override {
        if (++accepted == 3) {
            phase = "drain-3";
            start_drain();
        }
    }
    void on_message(proton::delivery&, proton::message& m) override { got.push_back(proton::get<std::string>(m.body())); }
    std::string progress() override { return "phase " + phase + ", received " + std::to_string(got.size()); }
};

// --------------------------------------------------------------------- consumer close

// Receive one and close, five times (JmsTemplate.receive()): each round opens a receiver
// with a prefetch of 10 on a queue of 5 messages, accepts the first message and closes
// the receiver with the rest unsettled.  A normal close is not a failed delivery
// attempt: every round must get the next message with delivery-count 0.
class ConsumerClose : public Scenario {
  public:
    using Scenario::Scenario;
    static const int ROUNDS = 5;
    std::string phase = "send";
    int sent = 0, accepted = 0;
    bool taken = false;
    proton::receiver rcv;
    std::vector<std::pair<std::string, uint32_t>> got;
    void begin() override { conn.open_sender(args.address); }
    void on_sendable(proton::sender& s) override {
        while (phase == "send" && s.credit() > 0 && sent < ROUNDS) {
            proton::message m;
            m.body("c" + std::to_string(sent++));
            s.send(m);
        }
    }
    void on_tracker_accept(proton::tracker&) override {
        if (phase == "send" && ++accepted == ROUNDS) {
            phase = "rounds";
            open_round();
        }
    }
    void open_round() {
        taken = false;
        rcv = conn.open_receiver(args.address, proton::receiver_options().credit_window(10).auto_accept(false));
    }
    void on_message(proton::delivery& d, proton::message& m) override {
        if (!(d.receiver() == rcv) || taken) return;   // the prefetched rest stays unsettled
        taken = true;
        got.emplace_back(proton::get<std::string>(m.body()), m.delivery_count());
        d.accept();
        d.receiver().close();
    }
    void on_receiver_close(proton::receiver& r) override {
        if (!(r == rcv) || phase != "rounds") return;
        if ((int)got.size() < ROUNDS) return open_round();
        Json rounds = Json::array();
        for (int i = 0; i < ROUNDS; i++) {
            if (got[i].first != "c" + std::to_string(i) || got[i].second != 0) {
                return fail("round " + std::to_string(i) + " got " + got[i].first + " with delivery-count " +
                            std::to_string(got[i].second) + ", expected c" + std::to_string(i) + " with 0");
            }
            Json pair = Json::array();
            pair.push(Json::string(got[i].first));
            pair.push(Json::number(got[i].second));
            rounds.push(pair);
        }
        Json details = Json::object();
        details.set("rounds", rounds);
        done(details);
    }
    std::string progress() override { return "phase " + phase + ", rounds " + std::to_string(got.size()); }
};

// --------------------------------------------------------------------- types

class TypesSender : public Scenario {
  public:
    using Scenario::Scenario;
    proton::message msg;
    bool sent = false;
    void begin() override {
        Expected e = load_expected(args.types_file, args.excluded);
        proton::value props;
        {
            codec::encoder enc(props);
            enc << codec::start::map();
            for (auto& kv : e.props.obj) { enc << kv.first; put(enc, kv.second); }
            enc << codec::finish();
        }
        msg.properties().value(props);
        proton::value body;
        {
            codec::encoder enc(body);
            put(enc, e.body);
        }
        msg.body(body);
        conn.open_sender(args.address);
    }
    void on_sendable(proton::sender& s) override {
        if (!sent) { sent = true; s.send(msg); }
    }
    void on_tracker_accept(proton::tracker&) override { done(); }
};

class TypesReceiver : public Scenario {
  public:
    using Scenario::Scenario;
    Expected expected;
    void begin() override {
        expected = load_expected(args.types_file, args.excluded);
        conn.open_receiver(args.address, proton::receiver_options().credit_window(1));
    }
    void on_message(proton::delivery&, proton::message& m) override {
        Json props = Json::object();
        const proton::value& pv = m.properties().value();
        if (!pv.empty()) {
            codec::decoder d(pv);
            codec::start s;
            d >> s;
            for (size_t i = 0; i < s.size; i += 2) {
                std::string key;
                d >> key;
                props.set(key, get(d));
            }
            d >> codec::finish();
        }
        Json body;
        {
            codec::decoder d(m.body());
            body = get(d);
        }
        std::vector<std::string> diffs;
        canon_equal(expected.props, props, "application_properties", diffs);
        canon_equal(expected.body, body, "body", diffs);
        if (!diffs.empty()) {
            std::string summary;
            Json all = Json::array();
            for (size_t i = 0; i < diffs.size(); i++) {
                if (i < 8) summary += (i ? "; " : "") + diffs[i];
                all.push(Json::string(diffs[i]));
            }
            Json d = Json::object();
            d.set("differences", all);
            return fail(std::to_string(diffs.size()) + " difference(s): " + summary, d);
        }
        Json d = Json::object();
        d.set("properties", Json::number(props.obj.size()));
        d.set("body_entries", Json::number(body["value"].arr.size()));
        done(d);
    }
};

// --------------------------------------------------------------------- main

static Scenario* make(const Args& a) {
    const std::string k = a.scenario + "/" + a.role;
    if (k == "queue/sender" || k == "topic/sender" || k == "shared-global/sender" || k == "shared-clientid/sender") return new Sender(a);
    if (k == "queue/receiver" || k == "topic/receiver") return new Receiver(a);
    if (k == "shared-global/receiver") return new GlobalSharedReceiver(a);
    if (k == "shared-clientid/receiver") return new ClientIdSharedReceiver(a);
    if (k == "unsubscribe/run") return new Unsubscribe(a);
    if (k == "selector/run") return new Selector(a);
    if (k == "large/run") return new Large(a);
    if (k == "drain/run") return new Drain(a);
    if (k == "consumer-close/run") return new ConsumerClose(a);
    if (k == "types/sender") return new TypesSender(a);
    if (k == "types/receiver") return new TypesReceiver(a);
    return nullptr;
}

static std::string exe_dir(const char* argv0) {
    std::string p = argv0;
    auto slash = p.rfind('/');
    return slash == std::string::npos ? "." : p.substr(0, slash);
}

int main(int argc, char** argv) {
    Args a;
    a.types_file = exe_dir(argv[0]) + "/../../types.json";
    Json base = Json::object();
    base.set("client", Json::string(CLIENT));
    try {
        for (int i = 1; i < argc; i++) {
            std::string k = argv[i];
            if (i + 1 >= argc) throw std::runtime_error("missing value for " + k);
            std::string v = argv[++i];
            if (k == "--url") a.url = v;
            else if (k == "--scenario") a.scenario = v;
            else if (k == "--role") a.role = v;
            else if (k == "--address") a.address = v;
            else if (k == "--count") a.count = std::stoi(v);
            else if (k == "--size") a.size = std::stoul(v);
            else if (k == "--sub") a.sub = v;
            else if (k == "--container-id") a.container_id = v;
            else if (k == "--link-name") a.link_name = v;
            else if (k == "--idle") a.idle = std::stod(v);
            else if (k == "--timeout") a.timeout = std::stod(v);
            else if (k == "--types-file") a.types_file = v;
            else if (k == "--exclude-types") a.exclude_types = v;
            else throw std::runtime_error("unknown option " + k);
        }
        if (a.scenario.empty()) throw std::runtime_error("--scenario is required");
        std::stringstream ss(a.exclude_types);
        std::string t;
        while (std::getline(ss, t, ',')) if (!t.empty()) a.excluded.insert(t);
    } catch (const std::exception& e) {
        base.set("result", Json::string("fail"));
        base.set("error", Json::string(e.what()));
        emit(base);
        return 2;
    }
    base.set("scenario", Json::string(a.scenario));
    base.set("role", Json::string(a.role));
    if (a.scenario == "info") {
        base.set("result", Json::string("pass"));
        base.set("library", Json::string("qpid-proton-cpp"));
        base.set("version", Json::string(std::to_string(PN_VERSION_MAJOR) + "." + std::to_string(PN_VERSION_MINOR) + "." + std::to_string(PN_VERSION_POINT)));
        base.set("unsupported_types", Json::array());
        base.set("transactions", Json::boolean(false));
        base.set("transactions_note", Json::string("proton-cpp 0.37 (Debian libqpid-proton-cpp12) has no transaction API; it arrived in 0.40"));
        emit(base);
        return 0;
    }
    if (a.scenario == "transaction") {
        base.set("result", Json::string("unsupported"));
        base.set("error", Json::string("proton-cpp 0.37 has no transaction API"));
        emit(base);
        return 3;
    }
    Scenario* s = make(a);
    if (!s) {
        base.set("result", Json::string("fail"));
        base.set("error", Json::string("unknown scenario/role " + a.scenario + "/" + a.role));
        emit(base);
        return 2;
    }
    try {
        proton::container c(*s, a.container_id);
        c.run();
    } catch (const std::exception& e) {
        if (!s->finished) s->fail(std::string("exception: ") + e.what());
    }
    if (!s->finished) s->fail("container stopped without a result");
    for (auto& kv : s->result.obj) base.set(kv.first, kv.second);
    base.set("elapsed_ms", Json::number(std::round((now_s() - s->t0) * 1000)));
    emit(base);
    bool ok = s->result["result"].str == "pass";
    delete s;
    return ok ? 0 : 1;
}
