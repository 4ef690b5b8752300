"""Paraphrased wordings of the TRAIN templates.

A student that sees one wording per TRAIN template learns eight sentences, not to read a problem,
and does not transfer to the HELD-OUT templates' other wordings. Each TRAIN template therefore has
14 *frames* (a statement and one or more asks, each its own scenario, nouns and verbs); a question
is a frame's statement and one of its asks, in that order or, with probability ``ASK_FIRST``, the
ask first (a word-order variant), with names and nouns drawn from pools. The first 12 frames of a
template are its TRAIN wordings, the last 2 its DEV wordings: the bench's selection set, never
trained on. The numbers' slots are the template's (``{a}``, ``{price}``, ...), filled by the
template in ``problems.py``; a frame may state them in another order than the template's steps.

Kept apart from the HELD-OUT templates (tested in ``test_synthetic_wordings.py``): no TRAIN or DEV
question shares a word 5-gram (numbers masked) with a HELD-OUT question, and none uses the
HELD-OUT scenarios' nouns (:data:`HELD_OUT_NOUNS`).
"""

from __future__ import annotations

import random
import string

ASK_FIRST = 0.2
DEV_FRAMES = 2
HELD_OUT_NOUNS: tuple[str, ...] = (
    "bus", "people", "lamp", "painter", "paint", "litres", "tins", "machine", "toys", "farm", "sheep",
    "animals", "pick",
)  # fmt: skip

NAMES = (
    "Ana", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kim", "Leo", "Mia", "Noor",
    "Omar", "Pia", "Raj", "Sam", "Tess", "Uma", "Vic", "Wen", "Yara", "Zed",
)  # fmt: skip
ITEMS = (
    "apples", "marbles", "stickers", "books", "cards", "shells", "coins", "pens", "stamps", "beads",
    "pencils", "buttons", "rocks", "cookies", "badges", "plums",
)  # fmt: skip

Frame = tuple[str, tuple[str, ...]]

FRAMES: dict[str, tuple[Frame, ...]] = {
    "add_sub": (  # a + b - c
        ("{name} has {a} {item}. {name} gets {b} more and then gives away {c}.",
         ("How many {item} does {name} have now?", "How many {item} are left with {name}?")),
        ("{name} had {a} {item}, found {b} more, then lost {c}.",
         ("How many {item} does {name} have now?", "How many {item} does {name} end up with?")),
        ("A jar holds {a} coins. {name} drops in {b} more coins and later takes out {c}.",
         ("How many coins are in the jar now?", "How many coins does the jar hold now?")),
        ("There are {a} birds in a tree. {b} more birds land on it, then {c} fly off.",
         ("How many birds are in the tree now?", "How many birds are still in the tree?")),
        ("A shelf has {a} books. The librarian adds {b} books and removes {c}.",
         ("How many books are on the shelf now?", "How many books does the shelf have after that?")),
        ("{name} collects {a} {item} on Monday and {b} on Tuesday, and then gives {c} to {name2}.",
         ("How many {item} does {name} keep?", "How many {item} does {name} have left?")),
        ("A pond has {a} ducks. {b} ducks swim in and {c} ducks fly away.",
         ("How many ducks are in the pond now?", "How many ducks are left in the pond?")),
        ("A baker makes {a} rolls in the morning and {b} rolls at noon. {c} rolls are sold.",
         ("How many rolls are left?", "How many rolls does the baker still have?")),
        ("A parking lot holds {a} cars. Then {b} cars drive in and {c} cars drive out.",
         ("How many cars are in the lot now?", "How many cars does the lot hold now?")),
        ("{name} saves ${a}. An aunt gives {name} ${b}, and {name} spends ${c}.",
         ("How many dollars does {name} have now?", "How much money, in dollars, does {name} have left?")),
        ("A tank holds {a} fish. {b} new fish are added and {c} are moved to another tank.",
         ("How many fish are in the tank now?", "How many fish does the tank have now?")),
        ("{name} starts with {a} {item}, wins {b} more in a game and trades away {c}.",
         ("How many {item} does {name} have now?", "How many {item} does {name} finish with?")),
        ("A box contains {a} crayons. {name} puts in {b} more and takes {c} out.",
         ("How many crayons are in the box now?",)),
        ("A garden has {a} roses. {b} more roses bloom and {c} roses are cut.",
         ("How many roses does the garden have now?",)),
    ),
    "percent_off": (  # price - price * pct / 100
        ("A coat costs ${price}. It is on sale for {pct}% off.",
         ("What is the sale price in dollars?", "How many dollars does the coat cost on sale?")),
        ("A bike is priced ${price}, and the store gives a {pct}% discount.",
         ("How much does the bike cost after the discount, in dollars?", "What does {name} pay for the bike in dollars?")),
        ("{name} wants a game that costs ${price}. Today the game is {pct}% off.",
         ("How many dollars does {name} pay?", "What is the price today in dollars?")),
        ("The price of a jacket is ${price}. During a sale the price drops by {pct}%.",
         ("What is the new price in dollars?", "How much is the jacket in the sale, in dollars?")),
        ("A ${price} watch gets a {pct}% discount.",
         ("What does the watch cost after the discount, in dollars?", "How many dollars is the discounted price?")),
        ("Shoes sell for ${price}. A coupon cuts {pct}% from that.",
         ("How many dollars do the shoes cost with the coupon?", "What is the price with the coupon, in dollars?")),
        ("{name} buys a tent marked ${price} with {pct}% off.",
         ("How much does {name} spend in dollars?", "How many dollars does {name} pay for the tent?")),
        ("A hotel room is ${price} a night. Members get {pct}% off.",
         ("How many dollars does a member pay for a night?", "What is the member price in dollars?")),
        ("During a {pct}% off sale, a radio that was ${price} is marked down.",
         ("What is its sale price in dollars?", "How many dollars does the radio cost in the sale?")),
        ("A ${price} phone is discounted by {pct} percent.",
         ("What is the discounted price in dollars?", "How many dollars does the phone cost now?")),
        ("A toaster normally sells for ${price}. This week it is {pct}% cheaper.",
         ("How much does it cost this week in dollars?", "What is this week's price in dollars?")),
        ("{name} sees a desk for ${price} and a sign saying {pct}% off.",
         ("How many dollars will {name} pay for the desk?", "What will the desk cost {name} in dollars?")),
        ("A sofa listed at ${price} is sold at {pct}% off.",
         ("How much is the sofa, in dollars, after the reduction?",)),
        ("Tickets cost ${price}, but students get {pct}% off.",
         ("How many dollars does a student pay?",)),
    ),
    "ratio_share": (  # total / (x + y) * x, the first-named part
        ("{name} and {name2} share {total} {item} in the ratio {x}:{y}.",
         ("How many does {name} get?", "How many {item} does {name} get?")),
        ("{total} {item} are split between {name} and {name2} in the ratio {x}:{y}.",
         ("How many {item} does {name} receive?", "What is {name}'s share?")),
        ("A bag of {total} sweets is divided between {name} and {name2} in the ratio {x}:{y}.",
         ("How many sweets does {name} get?", "How many sweets go to {name}?")),
        ("A class of {total} pupils has boys and girls in the ratio {x}:{y}.",
         ("How many boys are in the class?", "How many of the pupils are boys?")),
        ("A recipe mixes flour and sugar in the ratio {x}:{y} to make {total} grams.",
         ("How many grams of flour does it use?", "How many grams are flour?")),
        ("{name} and {name2} earn ${total} together and split it in the ratio {x}:{y}.",
         ("How many dollars does {name} get?", "What is {name}'s part in dollars?")),
        ("A garden of {total} flowers has red and yellow flowers in the ratio {x}:{y}.",
         ("How many red flowers are there?", "How many of the flowers are red?")),
        ("The ratio of cats to dogs at a shelter is {x}:{y}, and there are {total} cats and dogs in all.",
         ("How many cats are there?", "How many cats live at the shelter?")),
        ("A team scored {total} points, shared by {name} and {name2} in the ratio {x}:{y}.",
         ("How many points did {name} score?", "How many of the points are {name}'s?")),
        ("{total} stamps are shared by {name} and {name2} so that their shares are in the ratio {x}:{y}.",
         ("How many stamps does {name} have?", "What is {name}'s number of stamps?")),
        ("A rope {total} metres long is cut into two pieces in the ratio {x}:{y}.",
         ("How long, in metres, is the first piece?", "How many metres long is the first piece?")),
        ("A fruit bowl holds {total} pears and plums in the ratio {x}:{y}.",
         ("How many pears are in the bowl?", "How many of the fruits are pears?")),
        ("A club with {total} members has adults and children in the ratio {x}:{y}.",
         ("How many adults are in the club?",)),
        ("{name} and {name2} divide {total} beads in the ratio {x}:{y}.",
         ("How many beads does {name} end up with?",)),
    ),
    "linear_eq": (  # (c - b) / a
        ("{a}x + {b} = {c}.", ("Solve for x.", "What is x?")),
        ("{a}y + {b} = {c}.", ("Find y.", "What is the value of y?")),
        ("{a}n + {b} = {c}.", ("Solve for n.", "What number is n?")),
        ("{name} thinks of a number, multiplies it by {a}, then adds {b} and gets {c}.",
         ("What was the number?", "Which number did {name} think of?")),
        ("{a} times a number plus {b} equals {c}.", ("What is the number?", "Find the number.")),
        ("{name} buys {a} equal boxes and a ${b} bag, paying ${c} in all.",
         ("How many dollars is one box?", "What does each box cost in dollars?")),
        ("When a number is multiplied by {a} and {b} is added, the answer is {c}.",
         ("What is the number?", "Which number is it?")),
        ("{a} packs of cards plus {b} loose cards make {c} cards.",
         ("How many cards are in one pack?", "How many cards does each pack hold?")),
        ("The sum of {a} times k and {b} is {c}.", ("What is k?", "Find k.")),
        ("{a}m + {b} = {c}.", ("Find m.", "What is m?")),
        ("{name} has {a} bags with the same number of {item} in each and {b} {item} more, {c} {item} in all.",
         ("How many {item} are in each bag?", "How many {item} does one bag hold?")),
        ("Adding {b} to {a} times a number gives {c}.", ("What is the number?", "Find the number.")),
        ("{a}w + {b} = {c}.", ("What is w?",)),
        ("A number times {a}, plus {b}, is {c}.", ("What is that number?",)),
    ),
    "unit_price": (  # total / n * k
        ("{n} {item} cost ${total}.", ("How many dollars do {k} {item} cost?", "What do {k} {item} cost in dollars?")),
        ("{name} pays ${total} for {n} {item}.",
         ("At that price, how many dollars would {k} {item} cost?", "How many dollars would {k} {item} cost {name}?")),
        ("A printer prints {total} pages in {n} minutes.",
         ("How many pages does it print in {k} minutes?", "At that rate, how many pages come out in {k} minutes?")),
        ("{name} walks {total} km in {n} days at a steady pace.",
         ("How many km does {name} walk in {k} days?", "At that pace, how far in km does {name} walk in {k} days?")),
        ("{n} tickets cost ${total} in all.", ("How many dollars do {k} tickets cost?", "What is the cost of {k} tickets in dollars?")),
        ("In {n} days a bakery sells {total} pies.",
         ("How many pies does it sell in {k} days, at the same rate?", "At that rate, how many pies are sold in {k} days?")),
        ("A pump fills {total} buckets in {n} minutes.",
         ("How many buckets does it fill in {k} minutes?", "At that speed, how many buckets are filled in {k} minutes?")),
        ("{name} earns ${total} for {n} days of work.",
         ("How many dollars does {name} earn for {k} days?", "What does {name} earn in dollars for {k} days?")),
        ("{n} notebooks are sold for ${total}.", ("What is the price of {k} notebooks in dollars?", "How many dollars do {k} notebooks cost?")),
        ("A cyclist rides {total} miles in {n} days.",
         ("How many miles does the cyclist ride in {k} days at that rate?", "At that rate, how many miles in {k} days?")),
        ("{n} bags of rice weigh {total} kg.", ("How many kg do {k} bags weigh?", "What do {k} bags weigh in kg?")),
        ("{name} reads {total} pages in {n} evenings.",
         ("At the same rate, how many pages does {name} read in {k} evenings?", "How many pages does {name} read in {k} evenings?")),
        ("A tap drips {total} drops in {n} seconds.", ("How many drops fall in {k} seconds?",)),
        ("{n} boxes of tea cost ${total}.", ("How many dollars do {k} boxes of tea cost?",)),
    ),
    "fraction_rest": (  # n - n * p / q
        ("A class has {n} students. {p}/{q} of them walk to school.",
         ("How many do not walk?", "How many students do not walk to school?")),
        ("Of the {n} cars in a lot, {p}/{q} are red.", ("How many cars are not red?", "How many of the cars are some other colour?")),
        ("A box holds {n} balls, and {p}/{q} of the balls are green.", ("How many balls are not green?", "How many of the balls are not green?")),
        ("{name} has {n} {item} and gives {p}/{q} of them to {name2}.", ("How many {item} does {name} keep?", "How many {item} are left with {name}?")),
        ("There are {n} trees in a park, and {p}/{q} of the trees are oaks.", ("How many trees are not oaks?", "How many of the trees are not oaks?")),
        ("A club has {n} members. {p}/{q} of the members play chess.",
         ("How many members do not play chess?", "How many of the members do not play chess?")),
        ("{name} reads a book of {n} pages and has read {p}/{q} of it.", ("How many pages are left to read?", "How many pages has {name} still to read?")),
        ("In a school of {n} pupils, {p}/{q} eat lunch at home.",
         ("How many pupils do not eat lunch at home?", "How many pupils eat lunch at school?")),
        ("{p}/{q} of the {n} cookies in a tin are eaten.", ("How many cookies are not eaten?", "How many cookies remain?")),
        ("A team has {n} players and {p}/{q} of the players are forwards.",
         ("How many players are not forwards?", "How many of the players are not forwards?")),
        ("{name} plants {n} seeds and {p}/{q} of them sprout.", ("How many seeds do not sprout?", "How many of the seeds fail to sprout?")),
        ("A shop has {n} shirts, {p}/{q} of which are sold by noon.",
         ("How many shirts are still unsold at noon?", "How many shirts are left at noon?")),
        ("A bakery bakes {n} cakes and {p}/{q} of the cakes have icing.", ("How many cakes have no icing?",)),
        ("A hotel has {n} rooms and {p}/{q} of the rooms are booked.", ("How many rooms are free?",)),
    ),
    "fraction_sum": (  # a/b + c/d
        ("", ("What is {a}/{b} + {c}/{d}?", "Add {a}/{b} and {c}/{d}.")),
        ("{name} eats {a}/{b} of a pizza and {name2} eats {c}/{d} of it.",
         ("How much of the pizza do they eat together?", "What fraction of the pizza did they eat in all?")),
        ("A jug has {a}/{b} of a cup of milk and {c}/{d} of a cup more is added.",
         ("How many cups of milk are in the jug?", "How much milk, in cups, is in the jug?")),
        ("{name} walks {a}/{b} of a mile, then {c}/{d} of a mile.", ("How far does {name} walk in miles?", "How many miles does {name} walk?")),
        ("", ("Find the sum of {a}/{b} and {c}/{d}.", "What is the sum of {a}/{b} and {c}/{d}?")),
        ("", ("Work out {a}/{b} + {c}/{d}.", "Compute {a}/{b} plus {c}/{d}.")),
        ("A board is {a}/{b} of a metre long and another is {c}/{d} of a metre.",
         ("How long are the two boards together, in metres?", "How many metres do the two boards make?")),
        ("{name} spends {a}/{b} of an hour on maths and {c}/{d} of an hour on reading.",
         ("How many hours is that in all?", "How long, in hours, does {name} spend?")),
        ("A recipe needs {a}/{b} of a cup of sugar and {c}/{d} of a cup of flour.",
         ("How many cups is that in total?", "How many cups does the recipe need?")),
        ("", ("What do {a}/{b} and {c}/{d} add up to?", "{a}/{b} plus {c}/{d} is what?")),
        ("{name} cleans {a}/{b} of a fence in the morning and {c}/{d} in the afternoon.",
         ("What part of the fence is clean?", "How much of the fence does {name} clean?")),
        ("A tank is {a}/{b} full and {name} adds {c}/{d} of a tank more.", ("How full is the tank now?", "What fraction of the tank is full now?")),
        ("", ("Calculate {a}/{b} + {c}/{d}.",)),
        ("{name} runs {a}/{b} of a km and swims {c}/{d} of a km.", ("How many km is that altogether?",)),
    ),
    "shop_change": (  # paid - packs * price
        ("Each pack has {per} pens and costs ${price}. {name} buys {packs} packs and pays with ${paid}.",
         ("How much change does {name} get in dollars?", "How many dollars of change does {name} get?")),
        ("{name} buys {packs} packs of cards at ${price} each and pays with ${paid}. Each pack has {per} cards.",
         ("How much change does {name} get in dollars?", "How many dollars does {name} get back?")),
        ("A box of {per} crayons costs ${price}. {name} buys {packs} boxes with a ${paid} note.",
         ("How many dollars does {name} get back?", "What is the change in dollars?")),
        ("Muffins come {per} to a bag at ${price} a bag. {name} buys {packs} bags and hands over ${paid}.",
         ("What is {name}'s change in dollars?", "How many dollars of change are due?")),
        ("{name} pays ${paid} for {packs} packs of stickers that cost ${price} a pack, {per} stickers in each.",
         ("How much change, in dollars, should {name} get?", "How many dollars come back to {name}?")),
        ("At a shop, a pack of {per} pencils is ${price}. {name} gets {packs} packs and pays ${paid}.",
         ("How much change does {name} receive in dollars?", "What change, in dollars, does {name} get?")),
        ("Each crate holds {per} melons and sells for ${price}. A cafe buys {packs} crates and pays ${paid}.",
         ("How much change does the cafe receive in dollars?", "How many dollars of change does the cafe get?")),
        ("{name} has ${paid}. {name} buys {packs} bags of {per} oranges at ${price} a bag.",
         ("How many dollars does {name} have left?", "How much money, in dollars, is left?")),
        ("A roll of {per} tickets costs ${price}. {name} buys {packs} rolls and gives the clerk ${paid}.",
         ("What is {name}'s change in dollars?", "How many dollars does the clerk give back?")),
        ("With ${paid}, {name} buys {packs} cartons of eggs at ${price} a carton, {per} eggs to a carton.",
         ("How many dollars are left?", "How much does {name} have left in dollars?")),
        ("{name} orders {packs} sets of {per} cups. A set costs ${price} and {name} pays ${paid}.",
         ("How many dollars of change does {name} get?", "What change does {name} get in dollars?")),
        ("Socks come in packs of {per} for ${price}. {name} takes {packs} packs and pays ${paid}.",
         ("How much change is {name} given in dollars?", "How many dollars is {name}'s change?")),
        ("A tray of {per} buns costs ${price}. {name} buys {packs} trays and pays ${paid}.",
         ("How many dollars of change should {name} get back?",)),
        ("Batteries are sold {per} to a pack for ${price}. {name} gets {packs} packs, paying ${paid}.",
         ("What is the change, in dollars?",)),
    ),
}  # fmt: skip


def frames(template: str, pool: str) -> tuple[Frame, ...]:
    """The TRAIN (``pool="train"``) or DEV (``"dev"``) frames of a TRAIN template."""
    every = FRAMES[template]
    if pool == "train":
        return every[:-DEV_FRAMES]
    if pool == "dev":
        return every[-DEV_FRAMES:]
    raise ValueError(f"pool must be train or dev, got {pool!r}")


def wordings(template: str, pool: str) -> list[str]:
    """Every question pattern of the pool (frame x ask x order), slots unfilled."""
    out = []
    for statement, asks in frames(template, pool):
        for ask in asks:
            out += [f"{statement} {ask}".strip(), f"{ask} {statement}".strip()] if statement else [ask]
    return list(dict.fromkeys(out))


def question(template: str, pool: str, r: random.Random, **numbers: object) -> str:
    """One question of the pool with the template's ``numbers`` and names and nouns from ``r``."""
    statement, asks = r.choice(frames(template, pool))
    ask = r.choice(asks)
    ask_first = r.random() < ASK_FIRST
    name, name2 = r.sample(NAMES, 2)
    slots = {"name": name, "name2": name2, "item": r.choice(ITEMS), **numbers}
    text = f"{ask} {statement}" if ask_first else f"{statement} {ask}"
    return _capitalise(string.Formatter().vformat(text.strip(), (), slots))


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]
